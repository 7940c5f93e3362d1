"""``--auto``'s guard against speculation that does not pay: what steps deliver decides, not only what was predicted.

The cost model (``costs.py``) predicts a step from a curve timed on short chains at a 200-token prefix;
a real step at another context, with the tree builder's and the sampler's host work, costs 15-25% more on the
2-core CPU, and the decoder's own budget-0 step still pays a head forward. So where speculation is marginal (chat
at T=0.7, docs/hybrid.md) the per-step choice can keep taking trees that lose to plain decoding.

``SpeculationSwitch`` (one per request) compares seconds per token: the last speculative steps' (their wall time
over the tokens they emitted) against plain decoding's (the lean plain steps' own wall time once any ran; the cost
curve's plain-decoding time before, and a loss against that alone only buys a short measurement of plain steps).
When speculation is behind, the request takes ``stretch`` lean plain steps
(the decoder builds no tree and runs no head forward: the head's pairs wait and go in with one forward when
speculation resumes), then probes speculation again; the stretch doubles each time a probe loses and falls back
to the first length when one wins. Built and measured for batch 1: in a batch a step's time is every request's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class SpeculationSwitch:
    """plain_seconds: plain decoding's seconds per token before any lean step ran (the cost curve's baseline).
    window: speculative steps weighed at once (a full window is what a verdict needs while speculating, so a
    short unlucky run does not stop speculation that pays); probe_steps: the steps a probe after a stretch takes
    before its verdict; first_stretch / max_stretch: lean steps after the first loss / at most; measure_steps:
    the lean steps taken instead when the loss is against the prior alone (the curve's plain time comes from a
    200-token prefix: at a long context both sides are slower, so the verdict waits for realized plain steps)."""

    plain_seconds: float
    window: int = 8
    probe_steps: int = 4
    first_stretch: int = 8
    max_stretch: int = 128
    measure_steps: int = 2
    lean_left: int = 0  # lean plain steps still to take
    stretch: int = 0  # the next stretch's length (0: first_stretch)
    speculative: deque[tuple[float, int]] = field(default_factory=deque)  # (seconds, tokens) of recent steps
    plain: deque[float] = field(default_factory=deque)  # seconds of recent lean steps
    probing: bool = False  # the speculative steps since the last stretch are a probe

    def __post_init__(self) -> None:
        if not self.plain_seconds > 0:
            raise ValueError(f"plain_seconds must be > 0, got {self.plain_seconds}")
        if not 1 <= self.probe_steps <= self.window or not 1 <= self.first_stretch <= self.max_stretch \
                or self.measure_steps < 1:
            raise ValueError("need 1 <= probe_steps <= window, 1 <= first_stretch <= max_stretch, measure_steps >= 1")

    @property
    def lean(self) -> bool:
        """Whether the next step is a lean plain step."""
        return self.lean_left > 0

    def plain_rate(self) -> float:
        """Plain decoding's seconds per token: the median of the recent lean steps, else the prior."""
        if not self.plain:
            return self.plain_seconds
        ordered = sorted(self.plain)
        return ordered[len(ordered) // 2]

    def observe_plain(self, seconds: float) -> None:
        """A lean plain step (one token) took ``seconds``."""
        self.plain.append(seconds)
        if len(self.plain) > self.window:
            self.plain.popleft()
        self.lean_left = max(self.lean_left - 1, 0)

    def observe_speculative(self, seconds: float, tokens: int) -> None:
        """A speculative step emitted ``tokens`` in ``seconds``; once a verdict has its steps (a probe's
        ``probe_steps``, else a full window), a loss against plain decoding starts a lean stretch and a win
        resets the stretch length."""
        self.speculative.append((seconds, tokens))
        if len(self.speculative) > self.window:
            self.speculative.popleft()
        if len(self.speculative) < (self.probe_steps if self.probing else self.window):
            return
        rate = sum(s for s, _ in self.speculative) / max(sum(t for _, t in self.speculative), 1)
        if rate > self.plain_rate():
            if not self.plain:  # measured against the prior only: measure plain decoding here, then judge
                self.lean_left = self.measure_steps
            else:
                length = self.stretch or self.first_stretch
                self.lean_left = length
                self.stretch = min(2 * length, self.max_stretch)
            self.speculative.clear()  # the next verdict is the probe's own
            self.probing = True
        else:
            self.stretch = 0
            self.probing = False

    def forget_verdict(self) -> None:
        """New traffic (the requests judged have all left): the verdict and its stretches go, plain decoding's
        measured rate stays (the plugin's per-batch-size switch, whose requests change under it)."""
        self.lean_left = self.stretch = 0
        self.speculative.clear()
        self.probing = False
