"""--speculative-tree-auto's decision: start-up costs predict, measured seconds per token decide, per bucket."""

import math

import pytest

from sglang_spec.sglang_plugin.batch_switch import BAND_PROBE_SHARE, COLD, PLAIN, TREE, BatchSwitches, StepCosts

# a CPU-like table: a tree's verify costs little over a plain step for one request, 5x for 16
COSTS = StepCosts(plain={1: 0.05, 4: 0.08, 16: 0.2}, tree={1: 0.075, 4: 0.2, 16: 1.0}, tokens=16)


def run(switches, batch_size, steps, tree_seconds, tokens, plain_seconds):
    """Feeds ``steps`` steps to the bucket; returns the kinds of step taken."""
    kinds = []
    for _ in range(steps):
        kind = switches.decide(batch_size)
        kinds.append(kind)
        if kind == TREE:
            switches.observe(batch_size, False, tree_seconds, tokens)
        else:
            switches.observe(batch_size, True, plain_seconds, batch_size)
    return kinds


def test_trees_that_lose_to_plain_decoding_turn_off_and_winning_trees_stay_on():
    switches = BatchSwitches()  # no start-up costs: measured steps alone decide
    # batch 16: a tree step takes 3x a plain step and emits 1.5x its tokens -> mostly plain
    assert run(switches, 16, 200, tree_seconds=0.3, tokens=24, plain_seconds=0.1).count(PLAIN) > 150
    # batch 1 (its own bucket): a tree step takes 1.2x a plain step and emits 2.5 tokens -> trees, after the
    # first verdict's measurement of plain steps
    plain_at_one = run(switches, 1, 200, tree_seconds=0.06, tokens=2.5, plain_seconds=0.05).count(PLAIN)
    assert 0 < plain_at_one <= 4
    assert sorted(switches.switches) == [1, 16]
    assert switches.switch(9) is switches.switch(16) and switches.switch(3) is switches.switch(4)


def test_under_load_the_prediction_turns_trees_off_from_the_first_step_and_cold():
    switches = BatchSwitches(costs=COSTS)
    # one request: accept length 2.6 against a tree 1.5x a plain step -> trees
    kinds = run(switches, 1, 50, tree_seconds=0.09, tokens=2.6, plain_seconds=0.06)
    assert kinds.count(TREE) > 40 and COLD not in kinds
    # sixteen: 2.6 tokens against a tree 5x a plain step -> predicted ~0.5x: every step plain, cold, no tree tried
    kinds = run(switches, 16, 100, tree_seconds=1.2, tokens=16 * 2.6, plain_seconds=0.24)
    assert kinds == [COLD] * 100
    assert switches.predicted_speedup(16) < 1.0 < switches.predicted_speedup(1)


def test_prompts_joining_a_cold_batch_skip_the_heads_pass_and_others_keep_it():
    switches = BatchSwitches(costs=COSTS)
    # sixteen is cold at the prior accept length (predicted 2.0 * 0.2 / 1.0 = 0.4x); one and four are not
    assert switches.admit(3, 16) is True and switches.cold_admissions == 3
    assert switches.admit(1, 1) is False and switches.admit(4, 4) is False
    assert switches.admit(2, 16) is True and switches.cold_admissions == 5
    # a copy-heavy traffic (accept length 9: 1.8x predicted at sixteen) keeps every prompt's head pass
    run(switches, 1, 30, tree_seconds=0.075, tokens=9, plain_seconds=0.05)
    assert switches.admit(3, 16) is False and switches.cold_admissions == 5
    # without a start-up table nothing is predicted: every prompt is warm
    assert BatchSwitches().admit(16, 16) is False


def test_a_cold_batch_size_tries_a_tree_at_most_one_percent_of_its_time_and_follows_the_traffic():
    switches = BatchSwitches(costs=COSTS, accept_length=2.0)
    interval = switches.probe_interval(16)
    assert interval == 400  # a tree step costs 4 plain steps more than a plain one: 4 / 400 = 1%
    kinds = run(switches, 16, interval + 1, tree_seconds=1.0, tokens=16 * 2.0, plain_seconds=0.2)
    assert kinds[:interval] == [COLD] * interval and kinds[interval] == TREE
    # the traffic turns copy-heavy: one request's trees accept 9 tokens a step, and batch 16's prediction follows
    run(switches, 1, 30, tree_seconds=0.075, tokens=9, plain_seconds=0.05)
    assert switches.accept_length > 8
    assert switches.decide(16) == TREE


def test_a_cold_batch_probes_only_for_the_requests_it_can_learn_from():
    """A probe's tree step costs the whole batch, but only requests that never took a cold step teach the accept
    length (a cold request's head lacks KV): the interval grows by batch / warm, and an all-cold batch never
    probes."""
    switches = BatchSwitches(costs=COSTS, accept_length=2.0)
    interval = switches.probe_interval(16)
    for _ in range(4 * interval):
        assert switches.decide(16, warm=0) == COLD
        switches.observe(16, True, 0.2, 16)
    assert switches.decide(16, warm=4) == TREE  # 4 of 16 warm: due after 4x the interval
    switches.observe(16, False, 1.0, 16 * 2)
    for step in range(4 * interval + 1):
        kind = switches.decide(16, warm=4)
        assert kind == (TREE if step == 4 * interval else COLD)
        switches.observe(16, kind == COLD, 0.2 if kind == COLD else 1.0, 16 * (1 if kind == COLD else 2))
    assert switches.decide(16, warm=16) == COLD  # every request warm: the plain interval, just restarted


def test_the_scales_carry_what_served_steps_cost_over_the_start_up_table():
    switches = BatchSwitches(costs=COSTS)
    run(switches, 1, 20, tree_seconds=0.15, tokens=2.0, plain_seconds=0.1)  # served steps 2x the table
    assert switches.tree_scale == pytest.approx(2.0, rel=0.05)
    assert switches.switch(4).plain_seconds == pytest.approx(switches.plain_scale * 0.08 / 4)


def test_a_bucket_turning_off_says_so_in_one_line():
    switches = BatchSwitches()
    lines = [switches.observe(4, False, 1.0, 4) for _ in range(4)]
    assert lines[:3] == [None] * 3 and lines[3].startswith("tree auto, batches up to 4: plain (accept length")
    assert "\n" not in lines[3]
    switches = BatchSwitches(costs=COSTS)
    lines = [switches.observe(16, True, 0.24, 16) for _ in range(3)]
    assert lines[0].startswith("tree auto, batches up to 16: plain (predicted 0.") and lines[1:] == [None, None]


def test_a_batch_size_prices_its_trees_by_its_own_served_tree_steps():
    """Drafting and host work grow with the batch faster than the table's verify: one request's tree steps at the
    table's time leave batch 16 priced by the table until its own tree step shows 3x, and then by that."""
    switches = BatchSwitches(costs=COSTS)
    run(switches, 1, 20, tree_seconds=0.075, tokens=3.0, plain_seconds=0.05)  # the table's times
    assert switches.tree_scale_at(16) == pytest.approx(1.0)
    accept_length = switches.accept_length
    assert switches.predicted_speedup(16) == pytest.approx(accept_length * 0.2 / 1.0)
    switches.observe(16, False, 3.0, 16 * 3)  # a tree step at 16: 3x the table's 1.0 s
    assert switches.tree_scale_at(16) == pytest.approx(3.0) and switches.tree_scale_at(9) == pytest.approx(3.0)
    assert switches.tree_scale_at(1) == pytest.approx(1.0)
    assert switches.predicted_speedup(16) == pytest.approx(switches.accept_length * 0.2 / 3.0)
    assert switches.probe_interval(16) == math.ceil((3.0 / 0.2 - 1) / 0.01)  # 14 plain steps more: 1%


def test_step_costs_are_read_between_measured_batch_sizes():
    assert COSTS.plain_at(2) == pytest.approx(0.06) and COSTS.tree_at(32) == pytest.approx(2.0)
    assert COSTS.describe() == "1: 1.50x, 4: 2.50x, 16: 5.00x"
    with pytest.raises(ValueError, match="same non-empty batch sizes"):
        StepCosts(plain={1: 0.1}, tree={2: 0.2}, tokens=4)
    with pytest.raises(ValueError, match="positive"):
        StepCosts(plain={1: 0.0}, tree={1: 0.2}, tokens=4)


def test_a_low_accept_length_alone_never_turns_a_batch_size_cold_where_the_prior_would_win():
    """The server's warm-up (or an odd first request) teaches a low accept length; one request's trees, where the
    prior accept length would win, are then left to the measured switch (warm plain steps), never cold: cold steps
    would leave the head without KV, and its trees would confirm the low accept length for good."""
    switches = BatchSwitches(costs=COSTS)
    run(switches, 1, 20, tree_seconds=0.09, tokens=1.0, plain_seconds=0.06)
    assert switches.accept_length < 1.5 and switches.predicted_speedup(1) < 1.0
    assert switches.predicted_speedup(1, floor=True) > 1.0
    kinds = run(switches, 1, 40, tree_seconds=0.09, tokens=1.1, plain_seconds=0.06)
    assert COLD not in kinds and PLAIN in kinds  # measured: trees lose, warm plain stretches
    assert run(switches, 16, 20, tree_seconds=1.2, tokens=16 * 1.1, plain_seconds=0.24) == [COLD] * 20


def test_requests_that_took_cold_steps_do_not_teach_the_accept_length():
    switches = BatchSwitches(costs=COSTS)
    switches.observe(4, False, 0.2, 4 * 3, warm_requests=0, warm_tokens=0)
    assert switches.accept_length == 2.0 and switches.tree_steps == 1  # timed, not learnt from
    switches.observe(4, False, 0.2, 4 + 3 * 5, warm_requests=1, warm_tokens=5)  # one fresh request accepted 5
    assert switches.accept_length == pytest.approx(0.9 * 2.0 + 0.1 * 5)  # one request weighs 10%


def test_a_batch_size_predicted_to_lose_a_little_takes_warm_plain_steps_and_probes_trees_now_and_then():
    """Between COLD_BELOW and even the learnt accept length decides: warm plain steps (never cold: trees may
    return), a tree step at most BAND_PROBE_SHARE of the time, and trees again once the traffic accepts more."""
    switches = BatchSwitches(costs=COSTS)
    assert run(switches, 1, 30, tree_seconds=0.075, tokens=4.0, plain_seconds=0.05) == [TREE] * 30
    assert switches.predicted_speedup(16) == pytest.approx(0.8, rel=0.05)  # 4 tokens against a tree 5x plain
    kinds = run(switches, 16, 200, tree_seconds=1.0, tokens=16 * 4.0, plain_seconds=0.2)
    assert COLD not in kinds and 1 <= kinds.count(TREE) <= 200 * BAND_PROBE_SHARE / 4 + 1
    assert switches.probe_interval(16, BAND_PROBE_SHARE) == 80  # 4 plain steps extra a probe: 4 / 80 = 5%
    run(switches, 1, 10, tree_seconds=0.075, tokens=6.0, plain_seconds=0.05)  # copy-heavy traffic
    assert switches.decide(16) == TREE


def test_one_request_whose_trees_clearly_win_keeps_them_through_bursty_windows():
    """Copies come in bursts: four steps that accept nothing, then four that accept 4 drafts. Trees win 2x on
    average (predicted above TRUSTED_WIN throughout) and must not stop for the windows that lose; when the traffic
    stops copying for good the prediction falls and the measured switch turns trees off again."""
    switches = BatchSwitches(costs=COSTS)
    kinds = []
    for _ in range(20):
        for tokens in (1, 1, 1, 1, 5, 5, 5, 5):
            kind = switches.decide(1)
            kinds.append(kind)
            if kind == TREE:
                switches.observe(1, False, 0.075, tokens)
            else:
                switches.observe(1, True, 0.05, 1)
    assert switches.clear_win(1) and kinds.count(PLAIN) <= 2  # at most the first verdict's measurement
    assert PLAIN not in kinds[8:]
    kinds = run(switches, 1, 60, tree_seconds=0.075, tokens=1, plain_seconds=0.05)
    assert not switches.clear_win(1) and kinds[-20:].count(PLAIN) > 10


def serve(switches, rid, pattern, repeats, tree_seconds, plain_seconds, by_request=True):
    """One request alone (batch 1) for ``repeats`` x ``pattern`` steps, its tree steps accepting ``pattern``'s
    tokens in turn; with ``by_request`` the switch is told the request (as the plugin tells it); returns the kinds."""
    kinds = []
    rids = [rid] if by_request else None
    for _ in range(repeats):
        for tokens in pattern:
            kind = switches.decide(1, rids)
            kinds.append(kind)
            plain = kind != TREE
            emitted = 1 if plain else tokens
            switches.observe(1, plain, plain_seconds if plain else tree_seconds, emitted, rids=rids,
                             request_tokens={rid: emitted} if by_request else None)
    return kinds


COPIES = (1, 1, 4, 4, 3, 1, 5, 2)  # bursty copies, 2.6 tokens a tree step
CHAT = (1, 2, 1, 1, 2, 1, 1, 1)  # 1.25


def test_one_request_is_judged_on_its_own_trees_not_on_the_traffic_before_it():
    """At one request each answer is its own traffic: after the warm-up (trees accept nothing) a copy-heavy
    request's trees (2.6 tokens a step at 1.6x a plain step: 1.6x faster) are taken from its first steps, while a
    chatty one (1.25 tokens: 0.78x) is still turned plain; judged by the traffic's average alone (no request ids),
    the first copy-heavy answer spent most of its steps plain."""
    plain_steps = []
    for by_request in (False, True):
        switches = BatchSwitches(costs=COSTS)
        serve(switches, "warm-up", (1, 1, 1, 1), 2, 0.075, 0.05, by_request)
        plain_steps.append(serve(switches, "copy", COPIES, 2, 0.09, 0.056, by_request).count(PLAIN))
    assert plain_steps[0] >= 8 and plain_steps[1] == 0
    assert switches.request_accept["copy"] == pytest.approx(2.6, abs=0.2) and switches.accept_length < 2.6
    for index in range(4):  # copy-heavy and chatty answers in turn
        kinds = serve(switches, f"answer {index}", CHAT if index % 2 else COPIES, 3, 0.09, 0.056)
        assert kinds.count(PLAIN) >= 12 if index % 2 else kinds.count(PLAIN) == 0


def test_a_new_request_forgets_the_verdict_but_not_plain_decodings_rate():
    switches = BatchSwitches(costs=COSTS)
    serve(switches, "chat", CHAT, 3, 0.09, 0.056)
    switch = switches.switch(1)
    assert switch.lean and switch.plain_rate() == pytest.approx(0.056)
    assert switches.decide(1, ["chat"]) == PLAIN  # the same request: the stretch goes on
    assert switches.decide(1, ["next"]) == TREE and not switch.lean
    assert switch.plain_rate() == pytest.approx(0.056)
    # a batch that keeps any of its bucket's requests is the same traffic
    switches.decide(4, ["a", "b", "c", "d"])
    switches.switch(4).lean_left = 3
    switches.decide(4, ["d", "e", "f", "g"])
    assert switches.switch(4).lean
