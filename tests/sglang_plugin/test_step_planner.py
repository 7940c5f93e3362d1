"""Tree auto's plan state (``sglang_plugin/step_planner``): each request's predicted reach, the start-up cost table
corrected by the served steps, the cap; and two tensor-parallel ranks (gloo) with different local timings take
the same step (``peers.PlanGroup``)."""

from __future__ import annotations

import json
import random
import socket
from collections import deque

import pytest
import torch
import torch.distributed as dist

from sglang_spec.costs import CostCurve, CostTable
from sglang_spec.planner import SizeTable, StepPlan, plan_ragged, plan_step, size_table
from sglang_spec.sglang_plugin.peers import PlanGroup
from sglang_spec.sglang_plugin.step_planner import (ACCEPT_PRIOR_STEPS, ACCEPT_WINDOW, RETRY_STEPS, TREE_PRICE_MEMORY,
                                                    ServedTreeStep, StepPlanner, default_sizes, ragged_seconds,
                                                    tier_tokens)

FULL = 9


def cpu_like_table() -> CostTable:
    """A compute-bound target: one request's verify grows a little with its tokens, sixteen requests' a lot."""
    def curve(plain: float, per_token: float) -> CostCurve:
        return CostCurve(verify={size: plain + per_token * (size - 1) for size in (1, 2, 4, 8, FULL)},
                         draft_level=0.0, step_overhead=0.0, prefix=0, device="cpu")

    return CostTable({1: curve(0.05, 0.002), 4: curve(0.06, 0.008), 16: curve(0.10, 0.05)})


def planner(**fields) -> StepPlanner:
    return StepPlanner(cpu_like_table(), tuple(range(1, FULL + 1)), FULL, **fields)


def test_a_copy_heavy_request_gets_a_tree_and_a_crowded_chat_batch_a_plain_step():
    plan_state = planner()
    plan_state.learn_reach({"copy": [0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6], "chat": [0.3, 0.1, 0.05]})
    alone = plan_state.choose(plan_state.table(["copy"]), 1)
    assert alone.tokens == FULL  # cheap verification, every node pays
    crowded = [f"chat-{index}" for index in range(16)]
    plan_state.reach_of.update({rid: (0.3, 0.1, 0.05) for rid in crowded})
    assert plan_state.choose(plan_state.table(crowded), 16).plain
    # a request never drafted takes the traffic's reach by rank
    assert plan_state.predicted_reach("new")[:2] == pytest.approx(plan_state.prior[:2])


def test_the_cap_bounds_a_tree_step_against_a_plain_step():
    plan_state = planner(cap=1.2)
    plan_state.learn_reach({"copy": [0.99] * 8})
    plan = plan_state.choose(plan_state.table(["copy"] * 4), 4)
    assert 1 < plan.tokens < FULL and plan.predicted_seconds <= 1.2 * plan_state.seconds(4, 1)


def test_served_steps_correct_the_costs_and_the_accept_scale():
    plan_state = planner()
    plan_state.learn_reach({"a": [0.9] * 8})
    # plain steps take twice the start-up forward: the plain step's price doubles
    plain = StepPlan(1, 1.0, 0.05, (0,))
    for _ in range(30):
        plan_state.observe(plain, ["a"], 0.10, [1])
    assert plan_state.seconds(1, 1) == pytest.approx(0.10, rel=1e-3)
    # tree steps take 0.05 s more than their (scaled) verify, and accept 4 drafts where 7.2 were predicted
    for _ in range(30):
        table = plan_state.table(["a"])
        tree = StepPlan(FULL, table.expected[-1], table.seconds[-1], (8,))
        plan_state.observe(tree, ["a"], plan_state.seconds(1, FULL) - (plan_state.tree_extra(1) or 0) + 0.05,
                           [1 + 4])
    assert plan_state.tree_extra(1) == pytest.approx(0.05, rel=1e-2)
    # four requests, no tree step of theirs yet: one request's price grown as the start-up forward grows
    # (0.05 -> 0.06 s), not four times it
    assert plan_state.seconds(4, FULL) - plan_state.seconds(4, 1) == pytest.approx(
        0.05 * 0.06 / 0.05 + plan_state.plain_scale(4) * (0.06 + 0.008 * 8 - 0.06), rel=1e-2)
    assert plan_state.accept_scale(1) == pytest.approx(4 / 7.2, rel=1e-2)
    assert sum(plan_state.predicted_reach("a")) == pytest.approx(4.0, rel=1e-2)


def test_the_accept_scale_makes_the_chosen_steps_accept_what_they_predicted_in_sum_per_batch_bucket():
    """Steps predicted to accept little that accept more than predicted beside steps predicted to accept much that
    accept less (the planner takes a tree where its prediction is high): the scale is set so that the steps' accepted
    drafts sum to the predicted ones, not so that their ratios average 1, which would over-predict the high ones,
    and not below that either (noisy steps). Each batch-size bucket keeps its own; a bucket with none takes the
    nearest smaller one's."""
    plan_state = planner()
    # unscaled predictions 1 and 9 drafts, served 2 and 7: 9 of 10 in sum (each step's ratio averages 1.39)
    served = []
    for step in range(200):
        unscaled, accepted = (1.0, 2) if step % 2 else (9.0, 7)
        predicted = unscaled * plan_state.accept_scale(1)
        plan_state.observe(StepPlan(FULL, 1 + predicted, 0.06, (8,)), ["a"], 0.06, [1 + accepted])
        served.append((predicted, accepted))
    assert plan_state.accept_scale(1) == pytest.approx(0.9, abs=0.02)
    recent = served[-50:]
    assert sum(accepted for _, accepted in recent) == pytest.approx(sum(p for p, _ in recent), rel=0.02)
    # noisy steps: predicted 5 unscaled drafts, 0 or 8 accepted in a random half each (4 in expectation)
    noisy, generator = planner(), random.Random(0)
    served = []
    for _ in range(600):
        predicted = 5.0 * noisy.accept_scale(1)
        accepted = 8 if generator.random() < 0.5 else 0
        noisy.observe(StepPlan(FULL, 1 + predicted, 0.06, (8,)), ["a"], 0.06, [1 + accepted])
        served.append((predicted, accepted))
    recent = served[100:]
    assert sum(accepted for _, accepted in recent) == pytest.approx(sum(p for p, _ in recent), rel=0.05)
    # a batch of 16 that accepts half its prediction moves its own bucket's scale, not the single request's
    for _ in range(40):
        predicted = 8.0 * plan_state.accept_scale(16)
        plan_state.observe(StepPlan(FULL, 16 + predicted, 0.2, (8,) * 16), [f"r{i}" for i in range(16)], 0.2,
                           [1 + 4] + [1] * 15)
    assert plan_state.accept_scale(16) == pytest.approx(0.5, abs=0.05)
    assert plan_state.accept_scale(1) == pytest.approx(0.9, abs=0.05)
    assert plan_state.accept_scale(4) == plan_state.accept_scale(1)  # no tree step at 4: the smaller bucket's


def test_a_few_missed_trees_do_not_floor_the_accept_scale_and_many_do():
    """SGLang's warm-up request misses both its trees (0 of 2 predicted drafts each): the bucket's scale is not
    pinned at the range's floor for the first real requests, whose copies a tree accepts, as the bare ratio (0)
    would; a run of misses still brings it down, and a full window is the bare ratio of sums."""
    plan_state = planner()
    miss = StepPlan(FULL, 1 + 2.0, 0.06, (8,))
    for _ in range(2):
        plan_state.observe(miss, ["warm-up"], 0.06, [1])
    prior = ACCEPT_PRIOR_STEPS * (1 - 2 / ACCEPT_WINDOW)
    assert plan_state.accept_scale(1) == pytest.approx(prior / (2 + prior)) and plan_state.accept_scale(1) > 0.6
    for _ in range(8):
        plan_state.observe(StepPlan(FULL, 1 + 2.0 * plan_state.accept_scale(1), 0.06, (8,)), ["chat"], 0.06, [1])
    assert plan_state.accept_scale(1) < 0.3
    for _ in range(ACCEPT_WINDOW):  # a full window of steps accepting half their prediction: exactly half
        plan_state.observe(StepPlan(FULL, 1 + 4.0 * plan_state.accept_scale(1), 0.06, (8,)), ["copy"], 0.06, [1 + 2])
    assert plan_state.accept_scale(1) == pytest.approx(0.5)


def test_a_drafter_without_reach_is_planned_whole_from_its_served_accepts():
    assert default_sizes(FULL, graphs=False, ranked=False) == (1, FULL)
    assert default_sizes(FULL, graphs=False, ranked=True) == tuple(range(1, FULL + 1))
    assert default_sizes(64, graphs=True, ranked=True) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    plan_state = StepPlanner(cpu_like_table(), (1, FULL), FULL, ranked=False)
    full = StepPlan(FULL, 3.0, 0.06, (8,))
    for _ in range(20):
        plan_state.observe(full, ["a"], 0.066, [4])
    assert plan_state.predicted_reach("a")[-1] == pytest.approx(3.0, rel=1e-3)
    assert plan_state.choose(plan_state.table(["a"]), 1).tokens == FULL
    with pytest.raises(ValueError, match="include the tree's"):
        StepPlanner(None, (1, 4), FULL)


def test_a_request_whose_tree_missed_leaves_the_next_one_its_own_try_and_is_tried_again_later():
    """Unranked drafters: a miss (SGLang's warm-up request, a continuation's first tokens with nothing to copy)
    keeps that request plain for a while, not the requests after it; it is tried again after RETRY_STEPS steps,
    then twice as many after each further try, at most TREE_PRICE_MEMORY."""
    plan_state = StepPlanner(cpu_like_table(), (1, FULL), FULL, ranked=False, prior=[0.8, 0.6, 0.4])
    full = StepPlan(FULL, 2.8, 0.06, (8,))
    plan_state.observe(full, ["warm-up"], 0.07, [1])  # nothing accepted
    assert plan_state.choose(plan_state.table(["warm-up"]), 1).plain
    assert plan_state.predicted_reach("copy")[-1] == pytest.approx(1.8)  # the drafter's prior: a try of its own
    assert plan_state.choose(plan_state.table(["copy"]), 1).tokens == FULL
    plan_state.prior = [0.2, 0.1]  # a calibrated average below break-even: still at least one accepted draft
    assert plan_state.predicted_reach("copy")[-1] == pytest.approx(1.0)
    assert plan_state.choose(plan_state.table(["copy"]), 1).tokens == FULL
    gaps, plain_steps = [], 0
    while len(gaps) < 6:
        plan = plan_state.choose(plan_state.table(["warm-up"]), 1)
        plan_state.observe(plan, ["warm-up"], 0.05 if plan.plain else 0.07, [1])
        if plan.plain:
            plain_steps += 1
        else:
            gaps.append(plain_steps)
            plain_steps = 0
    assert gaps[1:] == [min(RETRY_STEPS << tries, TREE_PRICE_MEMORY) for tries in range(1, 6)], gaps


def test_without_a_start_up_table_each_size_is_tried_then_priced_as_served():
    plan_state = StepPlanner(None, (1, FULL), FULL)
    plan_state.learn_reach({"a": [0.2] * 8})
    assert plan_state.choose(plan_state.table(["a"]), 1).tokens == FULL  # unpriced: as cheap as a plain step
    plan_state.observe(StepPlan(FULL, 2.6, 0.0, (8,)), ["a"], 0.5, [1])
    plan_state.observe(StepPlan(1, 1.0, 0.0, (0,)), ["a"], 0.05, [1])
    assert plan_state.choose(plan_state.table(["a"]), 1).plain


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_plans(rank: int, port: int, folder: str) -> None:
    """Each rank's planner sees other step times (its own timings); both must take the same steps."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = PlanGroup(dist.group.WORLD)
        plan_state = planner()
        plan_state.learn_reach({rid: [0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05] for rid in "abcd"})
        chosen = []
        for step in range(12):
            table = group.agree(plan_state.table(list("abcd")))
            plan = plan_state.choose(table, 4)
            chosen.append(plan.tokens)
            # rank 1 is slow on tree steps, rank 0 on plain ones: alone they would plan differently
            slow = (rank == 1) != plan.plain
            plan_state.observe(plan, list("abcd"), (0.3 if slow else 0.05) * (1 + step % 3), [3, 2, 1, 4])
        with open(f"{folder}/rank{rank}.json", "w") as handle:
            json.dump({"chosen": chosen, "alone": plan_state.choose(plan_state.table(list("abcd")), 4).tokens},
                      handle)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_with_different_timings_take_identical_steps(tmp_path):
    torch.multiprocessing.spawn(rank_plans, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert ranks[0]["chosen"] == ranks[1]["chosen"]
    assert len(set(ranks[0]["chosen"])) > 1  # the steps moved with the agreed timings
    assert ranks[0]["alone"] != ranks[1]["alone"]  # negative control: left to itself, each rank would differ


def test_one_slow_step_of_a_shared_machine_moves_no_price():
    plan_state = planner()
    plain = StepPlan(1, 4.0, 0.06, (0,) * 4)
    for seconds in [0.06] * 6 + [0.6] + [0.06] * 2:  # one step ten times as slow, among nine
        plan_state.observe(plain, list("abcd"), seconds, [1] * 4)
    assert plan_state.plain_scale(4) == pytest.approx(1.0)
    assert plan_state.seconds(4, 1) == pytest.approx(0.06)


def test_a_bucket_without_tree_steps_borrows_a_neighbours_price():
    """One slow tree step served to one request must not price trees out at four: a smaller bucket's price grows as
    the start-up plain forward does (0.05 -> 0.06 s), not per request (a step's extra is partly the step's, whatever
    the batch); a bucket's own served tree steps replace the borrowed price; a larger bucket's is borrowed per
    request."""
    plan_state = planner()
    plan_state.learn_reach({rid: [0.9] * 8 for rid in "abcd"})
    verify = plan_state.seconds(1, FULL)
    plan_state.observe(StepPlan(FULL, 5.0, verify, (8,)), ["a"], verify + 0.03, [5])  # the shape's first: not priced
    plan_state.observe(StepPlan(FULL, 5.0, verify, (8,)), ["a"], verify + 0.03, [5])
    assert plan_state.tree_extra(1) == pytest.approx(0.03)
    assert plan_state.tree_extra(4) == pytest.approx(0.03 * 0.06 / 0.05)  # a smaller bucket's, grown
    assert plan_state.tree_extra(16) == pytest.approx(0.03 * 0.10 / 0.05)
    assert not plan_state.choose(plan_state.table(list("abcd")), 4).plain
    # the control: priced per request (0.12 s for four), the same trees are priced out
    per_request = planner()
    per_request.learn_reach({rid: [0.9] * 8 for rid in "abcd"})
    per_request.tree_seen[4] = deque([ServedTreeStep(0, 0.12, 0.0)])
    assert per_request.choose(per_request.table(list("abcd")), 4).plain
    # four requests' own tree steps replace the borrowed price; one request borrows theirs per request
    verify = plan_state.seconds(4, FULL) - plan_state.tree_extra(4)
    for _ in range(2):
        plan_state.observe(StepPlan(FULL, 20.0, verify, (8,) * 4), list("abcd"), verify + 0.12, [5] * 4)
    assert plan_state.tree_extra(4) == pytest.approx(0.12)
    fresh = planner()
    fresh.tree_seen[4] = deque([ServedTreeStep(0, 0.12, 0.0)])
    assert fresh.tree_extra(1) == pytest.approx(0.03)
    assert fresh.tree_extra(16) == pytest.approx(0.12 * 0.10 / 0.06)


def test_a_large_batch_does_not_try_trees_at_one_requests_price():
    """Where the forward is compute-bound (a batch of 16 twice one request's), a tree's rest served to one request
    is priced grown at 16: a thin predicted gain at that price would cost the whole batch a slow step."""
    plan_state = planner()
    crowd = [f"r{index}" for index in range(16)]
    plan_state.learn_reach({rid: [0.9] * 8 for rid in crowd})
    plan_state.tree_seen[1] = deque([ServedTreeStep(0, 0.03, 0.0)])
    assert plan_state.tree_extra(16) == pytest.approx(0.06)
    assert plan_state.choose(plan_state.table(crowd), 16).plain
    # the control: the same trees at one request's price, as it is, are taken
    as_is = planner()
    as_is.learn_reach({rid: [0.9] * 8 for rid in crowd})
    as_is.tree_seen[16] = deque([ServedTreeStep(0, 0.03, 0.0)])
    assert not as_is.choose(as_is.table(crowd), 16).plain


def test_a_trees_rest_is_at_least_the_drafting_it_measured():
    """A bucket's plain scale learnt from its few slow plain steps (a server's first) reads its trees' verify as
    dearer than the whole served step: the rest beyond it is still the head rounds the trees were measured to
    take, and a batch of 16 borrowing that price (grown) keeps a plain step its thin predicted gain would not
    pay for. The control: the same steps with no measured drafting price the rest at nothing, and 16 requests
    try the tree."""
    crowd = [f"r{index}" for index in range(16)]
    chosen = {}
    for drafting in (0.02, 0.0):
        plan_state = planner()
        for _ in range(3):  # a shape's first step is not priced; then two slow plain steps (scale 1.6)
            plan_state.observe(StepPlan(1, 1.0, 0.05, (0,)), ["a"], 0.08, [1])
        verify = plan_state.costs.at(1).verify[FULL]
        for _ in range(2):  # tree steps that accept what they predicted, their head rounds 0.02 s of them
            plan_state.observe(StepPlan(FULL, 5.0, verify, (8,)), ["a"], verify + 0.02, [5],
                               drafting_seconds=drafting)
        assert plan_state.plain_scale(1) == pytest.approx(1.6)
        assert plan_state.tree_extra(1) == pytest.approx(drafting)
        assert plan_state.tree_extra(16) == pytest.approx(drafting * 0.10 / 0.05)
        plan_state.learn_reach({rid: [0.6, 0.1, 0.05] for rid in crowd})
        chosen[drafting] = plan_state.choose(plan_state.table(crowd), 16)
    assert chosen[0.02].plain
    assert chosen[0.0].tokens == 2  # the control


def test_a_borrowed_drafting_grows_as_a_forward_of_the_heads_beams():
    """One request's tree step lent to sixteen: its head rounds (0.02 s of its 0.03 s rest) grow as the start-up
    forward of the head's 4 beams a request grows (0.056 -> 0.25 s), its host work as the plain forward (0.05 ->
    0.10 s), and trees near break-even at that price stay off. The control: drafting grown as the plain forward
    (one beam a request) prices the same trees in."""
    crowd = [f"r{index}" for index in range(16)]
    chosen = {}
    for width in (4, 1):
        plan_state = planner(width=width, cap=10.0)
        forward = plan_state.costs.at(1).verify[FULL]
        plan_state.tree_seen[1] = deque([ServedTreeStep(0, forward + 0.03, forward, 0.02)])
        plan_state.learn_reach({rid: [0.6] * 8 for rid in crowd})
        chosen[width] = plan_state.choose(plan_state.table(crowd), 16)
        if width == 4:
            assert plan_state.tree_extra(16) == pytest.approx(0.02 * 0.25 / 0.056 + 0.01 * 0.10 / 0.05)
        else:
            assert plan_state.tree_extra(16) == pytest.approx(0.03 * 0.10 / 0.05)
    assert chosen[4].plain
    assert chosen[1].tokens == FULL  # the control


def test_one_fast_tree_step_among_slower_ones_does_not_price_the_trees():
    """Trees that lose to a plain step stay off when one of their steps happened to run fast: the price is the
    median of the recent tree steps, not the least (the least kept buying trees that lost)."""
    plan_state = planner()
    plan_state.learn_reach({rid: [0.5, 0.2] + [0.05] * 6 for rid in "abcd"})
    for _ in range(5):
        plan_state.observe(StepPlan(1, 4.0, 0.06, (0,) * 4), list("abcd"), plan_state.seconds(4, 1), [1] * 4)
    verify = plan_state.seconds(4, 2) - (plan_state.tree_extra(4) or 0.0)
    for extra in (0.0, 0.0, 0.08, 0.08, 0.08):  # the shape's first is not priced; then one fast among slower
        plan_state.observe(StepPlan(2, 6.0, verify, (1,) * 4), list("abcd"), verify + extra, [2, 1, 2, 1])
    assert plan_state.tree_extra(4) == pytest.approx(0.08)
    assert plan_state.choose(plan_state.table(list("abcd")), 4).plain
    # the control: priced by its fastest step, the same trees are taken
    fastest = planner()
    fastest.learn_reach({rid: [0.5, 0.2] + [0.05] * 6 for rid in "abcd"})
    fastest.plain_seen = plan_state.plain_seen
    fastest.tree_seen[4] = deque([min(plan_state.tree_seen[4], key=lambda entry: entry.seconds)])
    assert not fastest.choose(fastest.table(list("abcd")), 4).plain


def test_a_tree_step_served_before_any_plain_step_is_priced_against_the_plain_steps_learnt_later():
    """A server's first steps run slower than its start-up table (and a tree step may come first): the part of a
    tree step's time a plain step would have taken too is the verify's, not the tree's."""
    plan_state = planner()
    forward = plan_state.seconds(1, FULL)
    for _ in range(2):  # the shape's first step is not priced
        plan_state.observe(StepPlan(FULL, 5.0, forward, (8,)), ["a"], 2 * forward + 0.01, [5])
    assert plan_state.tree_extra(1) == pytest.approx(forward + 0.01)  # the start-up table's price: no plain step yet
    for _ in range(5):  # plain steps take twice the start-up forward
        plan_state.observe(StepPlan(1, 1.0, 0.05, (0,)), ["a"], 0.10, [1])
    assert plan_state.tree_extra(1) == pytest.approx(0.01)
    assert plan_state.plain_scale(4) == pytest.approx(2.0)  # a bucket with no plain step takes its neighbour's


WINDOW_STEPS = 12


def test_a_slow_spell_of_tree_steps_does_not_keep_trees_off_for_good():
    """Tree steps served during a slow spell price trees out; plain steps alone cannot correct that price, so it
    expires after TREE_PRICE_MEMORY steps and a tree is tried again (and kept, where it pays)."""
    from sglang_spec.sglang_plugin.step_planner import TREE_PRICE_MEMORY

    plan_state = planner()
    plan_state.learn_reach({"copy": [0.9] * 8})
    for _ in range(WINDOW_STEPS):  # a slow spell: every tree step takes a second
        table = plan_state.table(["copy"])
        tree = plan_state.choose(table, 1)
        plan_state.observe(tree, ["copy"], 1.0 if not tree.plain else 0.06, [5] if not tree.plain else [1])
    tried_again = None
    for step in range(2 * TREE_PRICE_MEMORY):
        plan = plan_state.choose(plan_state.table(["copy"]), 1)
        if not plan.plain:
            tried_again = step
            break
        plan_state.observe(plan, ["copy"], 0.06, [1])  # the machine is fast again
    assert tried_again is not None and tried_again <= TREE_PRICE_MEMORY
    # the negative control: with the price kept for good, no tree comes back
    stuck = planner()
    stuck.learn_reach({"copy": [0.9] * 8})
    stuck.tree_seen[1] = deque([ServedTreeStep(10 ** 9, 1.0, 0.0)] * 3)
    assert all(stuck.choose(stuck.table(["copy"]), 1).plain for _ in range(2 * TREE_PRICE_MEMORY))


def rank_beside_an_idle_one(rank: int, port: int, folder: str) -> None:
    """Rank 0 decodes four requests; rank 1 is DP attention's idle rank (no request, an empty table). Both time
    their steps differently; head-level prices are fed the group's slowest times (and, as a control, the rank's
    own)."""
    from sglang_spec.planner import SizeTable
    from sglang_spec.sglang_plugin.level_costs import LevelCosts

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = PlanGroup(dist.group.WORLD)
        plan_state = planner()
        plan_state.learn_reach({rid: [0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05] for rid in "abcd"})
        agreed, own = LevelCosts(), LevelCosts()
        sizes = []
        for step in range(10):
            if rank == 0:
                table = group.agree(plan_state.table(list("abcd")))
                plan = plan_state.choose(table, 4)
                plan_state.observe(plan, list("abcd"), 0.05 * (1 + step % 3) * plan.tokens, [3, 2, 1, 4])
                sizes.append(plan.tokens)
            else:
                zeros = (0.0,) * len(plan_state.sizes)
                sizes.append(plan_state.size_for(group.agree(SizeTable(plan_state.sizes, zeros, zeros))))
            step_seconds, rounds_seconds = 0.1 * (1 + rank) * (1 + step % 2), 0.02 * (2 - rank)
            own.observe(4, step_seconds, 2, rounds_seconds)
            slowest_step, slowest_rounds = group.slowest(step_seconds, rounds_seconds)
            agreed.observe(4, slowest_step, 2, slowest_rounds)
        with open(f"{folder}/rank{rank}.json", "w") as handle:
            json.dump({"sizes": sizes, "steps": plan_state.steps,
                       "agreed": [agreed.round_seconds[4], agreed.rest_seconds[4]],
                       "own": [own.round_seconds[4], own.rest_seconds[4]]}, handle)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_an_idle_rank_takes_the_groups_size_and_level_prices_agree(tmp_path):
    """What DP attention needs of the ranks' head forwards: an idle rank runs the decoding ranks' verify size (its
    draft's head forwards pair up with theirs), without counting a step of its own; head-level prices fed the
    group's slowest times are the same on every rank (a rank's own times would not be)."""
    torch.multiprocessing.spawn(rank_beside_an_idle_one, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert ranks[0]["sizes"] == ranks[1]["sizes"] and len(set(ranks[0]["sizes"])) > 1
    assert ranks[1]["steps"] == 0  # the idle rank planned no step of its own
    assert ranks[0]["agreed"] == ranks[1]["agreed"]
    assert ranks[0]["own"] != ranks[1]["own"]  # negative control


def crowded_chat(plan_state: StepPlanner) -> list[str]:
    """Sixteen chat requests: a batch the planner decodes plainly (see the first test)."""
    rids = [f"chat-{index}" for index in range(16)]
    plan_state.reach_of.update({rid: (0.3, 0.1, 0.05) for rid in rids})
    return rids


def test_the_head_rests_after_a_run_of_plain_steps_and_a_tree_waits_one_warm_up_step():
    """The head at rest: after ``head_rest`` plain steps in a row a plain step leaves the head's draft extend out;
    a tree chosen right after such a step is taken plain (running the extend, so the next step's tree has the
    head's candidates); the tree the planner still wants follows."""
    plan_state = planner(head_rest=3)
    crowded = crowded_chat(plan_state)
    rested = []
    for _ in range(5):
        assert plan_state.choose(plan_state.table(crowded), 16).plain
        rested.append(plan_state.skip_head)
    assert rested == [False, False, False, True, True]
    plan_state.learn_reach({"copy": [0.95] * 8})
    warm_up = plan_state.choose(plan_state.table(["copy"]), 1)
    assert warm_up.plain and plan_state.head_warmup and not plan_state.skip_head
    assert warm_up.expected_tokens == 1.0  # priced as the plain step it is
    tree = plan_state.choose(plan_state.table(["copy"]), 1)
    assert tree.tokens == FULL and not plan_state.head_warmup and not plan_state.skip_head
    # a tree resets the run: the head runs the next head_rest plain steps again
    assert [plan_state.choose(plan_state.table(crowded), 16).plain and plan_state.skip_head
            for _ in range(4)] == [False, False, False, True]
    assert plan_state.chosen[1] == 5 + 1 + 4 and plan_state.chosen[FULL] == 1


def test_without_a_head_rest_the_head_runs_every_plain_step_and_no_tree_waits():
    """Negative control of the rule above: ``head_rest`` None (a drafter that never runs the head, DP attention)."""
    plan_state = planner()
    crowded = crowded_chat(plan_state)
    for _ in range(20):
        plan_state.choose(plan_state.table(crowded), 16)
        assert not plan_state.skip_head
    plan_state.learn_reach({"copy": [0.95] * 8})
    assert plan_state.choose(plan_state.table(["copy"]), 1).tokens == FULL and not plan_state.head_warmup


def test_an_idle_rank_rests_the_head_at_the_groups_steps():
    """``size_for`` (a rank with no request of its own, or one whose plan failed: ``take(1)``) follows the same
    rule from the agreed sizes, so its head forwards pair up with the decoding ranks'."""
    decoding, idle = planner(head_rest=2), planner(head_rest=2)
    crowded = crowded_chat(decoding)
    decoding.learn_reach({"copy": [0.95] * 8})
    for rids in [crowded] * 4 + [["copy"]] * 2 + [crowded] * 3:
        table = decoding.table(rids)
        plan = decoding.choose(table, len(rids))
        assert idle.size_for(table) == plan.tokens
        assert (idle.skip_head, idle.head_warmup) == (decoding.skip_head, decoding.head_warmup)
    assert idle.steps == 0


def test_a_head_rest_below_one_plain_step_is_refused():
    with pytest.raises(ValueError, match="head rests after >= 1 plain step"):
        planner(head_rest=0)


def test_a_ragged_step_gives_each_request_its_share_and_a_warm_up_step_none():
    plan_state = planner(ragged=True, head_rest=1)
    plan_state.learn_reach({"copy": [0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6]})
    plan_state.reach_of["chat"] = (0.05, 0.02)
    rids = ["chat", "copy", "chat", "copy"]
    table = plan_state.table(rids)
    local = plan_state.ragged_plan(table, rids)
    plan = plan_state.take_ragged(table, local, local.nodes)
    assert plan.nodes[1] == plan.nodes[3] > 0 and plan.nodes[0] == plan.nodes[2] == 0
    assert plan.tokens == plan.nodes[1] + 1
    # served (a shape's first step allocates, so the second is priced): against the forward of the tokens it
    # verified, not of its width for every request
    for _ in range(2):
        plan_state.observe(plan, rids, 0.2, [5, 1, 5, 1], verified_tokens=4 + sum(plan.nodes))
    verified = 1 + sum(plan.nodes) / 4
    assert plan_state.tree_seen[4][-1].forward == pytest.approx(0.06 + 0.008 * (verified - 1))
    assert verified < plan.tokens
    # after the head rested, a tree is a plain warm-up step: no request gets a share
    plan_state.skip_head = True
    warm_up = plan_state.take_ragged(table, plan, plan.nodes)
    assert warm_up.plain and warm_up.nodes == (0,) * 4 and plan_state.head_warmup


def test_on_ragged_verify_graphs_a_step_is_priced_at_its_tier_and_fills_it():
    """The tier's pad tokens are computed anyway: a step priced at its tier takes the next-best nodes up to it
    (here every node of positive reach that fits), runs at the full width, and its served time is read against
    the forward of its tier's tokens. Without tiers the same requests stop where the next node's reach no longer
    pays for its own tokens (negative control)."""
    reach = {"copy": [0.95, 0.9, 0.6, 0.3, 0.2, 0.15, 0.1, 0.05], "chat": [0.1, 0.05]}
    rids = ["copy", "chat"]
    plans = {}
    for tiers in (None, (9, 18, 36)):
        plan_state = planner(ragged=True)
        plan_state.tiers = tiers
        plan_state.learn_reach(reach)
        table = plan_state.table(rids)
        plans[tiers] = plan_state.take_ragged(table, plan_state.ragged_plan(table, rids),
                                              plan_state.ragged_plan(table, rids).nodes)
    untiered, tiered = plans[None], plans[(9, 18, 36)]
    assert untiered.nodes == (5, 0) and untiered.tokens == 6  # 7 tokens: the 6th copy node does not pay
    assert 2 + sum(tiered.nodes) == 9 and tiered.tokens == FULL  # the 9-token tier filled, at the full width
    assert tiered.expected_tokens > untiered.expected_tokens
    for plan_state, plan in ((planner(ragged=True, tiers=(9, 18, 36)), tiered), (planner(ragged=True), untiered)):
        for _ in range(2):  # a shape's first step allocates: the second is priced
            plan_state.observe(plan, rids, 0.2, [3, 1], verified_tokens=2 + sum(plan.nodes))
        # read against the forward it was priced at: the tier's 9 tokens, or the 7 it verified without tiers
        assert plan_state.tree_seen[2][-1].forward == pytest.approx(plan.predicted_seconds)
    assert tiered.predicted_seconds > untiered.predicted_seconds
    assert tier_tokens(11, (9, 18, 36)) == 18 and tier_tokens(40, (9, 18, 36)) == 40 and tier_tokens(7, None) == 7


def rank_ragged_plans(rank: int, port: int, folder: str) -> None:
    """Two ranks of one group whose timings differ and whose predictions for one request differ a little (as a
    fault that left one rank's counts behind would make them): the agreed table and the least shares give both the
    same ragged steps."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = PlanGroup(dist.group.WORLD)
        plan_state = planner(ragged=True)
        plan_state.learn_reach({"a": [0.9, 0.8, 0.7, 0.6, 0.5, 0.4], "b": [0.3, 0.1], "c": [0.95] * 8,
                                "d": [0.6, 0.5, 0.2 + 0.5 * rank, 0.15 + 0.5 * rank, 0.1]})
        rids = list("abcd")
        chosen, alone = [], []
        for step in range(8):
            table = group.agree(plan_state.table(rids))
            local = plan_state.ragged_plan(table, rids)
            plan = plan_state.take_ragged(table, local, group.least(local.nodes))
            chosen.append(list(plan.nodes))
            alone.append(list(local.nodes))
            slow = (rank == 1) != plan.plain
            plan_state.observe(plan, rids, (0.3 if slow else 0.05) * (1 + step % 3), [3, 1, 5, 2],
                               verified_tokens=4 + sum(plan.nodes))
        with open(f"{folder}/rank{rank}.json", "w") as handle:
            json.dump({"chosen": chosen, "alone": alone}, handle)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_take_identical_ragged_steps(tmp_path):
    torch.multiprocessing.spawn(rank_ragged_plans, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert ranks[0]["chosen"] == ranks[1]["chosen"]
    assert any(len(set(nodes)) > 1 for nodes in ranks[0]["chosen"])  # requests got different shares
    assert ranks[0]["alone"] != ranks[1]["alone"]  # negative control: each rank's own shares differ


def linear(plain: float, per_token: float):
    return lambda tokens: plain + per_token * (tokens - 1)


@pytest.mark.parametrize("reach", [[0.9, 0.8, 0.5, 0.2, 0.05], [0.3, 0.1], [0.99] * 8, []])
def test_at_one_request_the_ragged_plan_is_the_uniform_one(reach):
    """One chooser: at batch 1 (the reference decoder's case) both rules take the same size, read off the same
    table."""
    table = size_table([reach], linear(1.0, 0.15), range(1, 10))
    seconds = ragged_seconds(table)
    assert [seconds(size) for size in table.sizes] == list(table.seconds)
    assert plan_ragged([reach], seconds, range(1, 10)).tokens == plan_step([reach], linear(1.0, 0.15),
                                                                           range(1, 10)).tokens


def test_a_tree_step_below_the_smallest_tree_size_pays_that_size():
    table = SizeTable((1, 4, 8), (1.0, 2.0, 3.0), (1.0, 1.6, 2.0))
    seconds = ragged_seconds(table)
    assert seconds(1.0) == 1.0 and seconds(1.25) == 1.6 and seconds(6.0) == pytest.approx(1.8)
