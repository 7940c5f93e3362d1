"""SpeculationSwitch: lean plain stretches start when speculative steps deliver tokens slower than plain decoding,
double while probes keep losing, reset when one wins; realized plain steps replace the prior."""

import pytest

from sglang_spec.decode.switch import SpeculationSwitch


def run(switch: SpeculationSwitch, steps: list[tuple[float, int]]) -> list[bool]:
    """Feeds speculative steps, taking the lean steps the switch asks for in between (each at 0.03 s);
    returns, per speculative step, whether a lean stretch followed it."""
    followed = []
    for seconds, tokens in steps:
        switch.observe_speculative(seconds, tokens)
        followed.append(switch.lean)
        while switch.lean:
            switch.observe_plain(0.03)
    return followed


def test_speculation_that_pays_never_goes_lean() -> None:
    switch = SpeculationSwitch(plain_seconds=0.03)
    assert run(switch, [(0.045, 3)] * 20) == [False] * 20  # 15 ms a token against 30


def test_a_loss_starts_a_stretch_that_doubles_and_a_win_resets_it() -> None:
    switch = SpeculationSwitch(plain_seconds=0.03, window=8, probe_steps=4, first_stretch=8, max_stretch=32)
    for _ in range(7):  # while speculating, a verdict waits for a full window
        switch.observe_speculative(0.05, 1)
        assert not switch.lean
    switch.observe_speculative(0.05, 1)  # 50 ms a token against the prior's 30: first, measure plain steps
    lengths = [switch.lean_left]
    while switch.lean:
        switch.observe_plain(0.03)
    for _ in range(3):  # three probes of 4 losing steps
        for _ in range(4):
            switch.observe_speculative(0.05, 1)
        lengths.append(switch.lean_left)
        while switch.lean:
            switch.observe_plain(0.03)
    assert lengths == [2, 8, 16, 32]
    for _ in range(4):  # a winning probe
        switch.observe_speculative(0.04, 2)
    assert not switch.lean and switch.stretch == 0
    for _ in range(8):  # losses again: once they outweigh the win in the window, a first-length stretch
        switch.observe_speculative(0.05, 1)
        if switch.lean:
            break
    assert switch.lean_left == 8


def test_realized_plain_steps_replace_the_prior() -> None:
    # the curve says plain decoding costs 10 ms a token, so 20 ms a token of speculation loses at first ...
    switch = SpeculationSwitch(plain_seconds=0.01, window=2, probe_steps=2, first_stretch=3)
    switch.observe_speculative(0.04, 2)
    switch.observe_speculative(0.04, 2)
    assert switch.lean_left == 2  # a measurement, not a stretch
    for _ in range(2):  # ... and plain steps really take 30 ms here
        switch.observe_plain(0.03)
    assert switch.plain_rate() == pytest.approx(0.03)
    switch.observe_speculative(0.04, 2)
    switch.observe_speculative(0.04, 2)
    assert not switch.lean  # 20 ms against 30: speculation pays after all


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="plain_seconds must be > 0"):
        SpeculationSwitch(plain_seconds=0.0)
    with pytest.raises(ValueError, match="probe_steps <= window"):
        SpeculationSwitch(plain_seconds=0.01, window=2, probe_steps=3)
    with pytest.raises(ValueError, match="measure_steps >= 1"):
        SpeculationSwitch(plain_seconds=0.01, measure_steps=0)
