"""``plan_step``: the verify size with the least predicted seconds per token, under the step-time cap;
``plan_ragged``: each request's share of a ragged step's nodes, under the same rule."""

from __future__ import annotations

import pytest

from sglang_spec.planner import expected_tokens, plan_ragged, plan_step


def linear_seconds(plain: float, per_token: float):
    """A step whose time grows linearly with the tokens each request verifies (a compute-bound target)."""
    return lambda tokens: plain + per_token * (tokens - 1)


def test_the_plan_is_the_size_with_the_least_seconds_per_token_by_brute_force():
    reach = [[0.9, 0.8, 0.5, 0.2, 0.05], [0.3, 0.1], []]
    seconds = linear_seconds(1.0, 0.15)
    plan = plan_step(reach, seconds, sizes=range(1, 7))
    best = min(range(1, 7), key=lambda size: (seconds(size) / expected_tokens(reach, size), size))
    assert plan.tokens == best
    assert plan.nodes == tuple(min(best - 1, len(nodes)) for nodes in reach)
    assert plan.expected_tokens == pytest.approx(3 + sum(sum(nodes[: best - 1]) for nodes in reach))


def test_cheap_verification_takes_the_whole_tree_and_dear_verification_a_plain_step():
    reach = [[0.9, 0.8, 0.7]]
    assert plan_step(reach, linear_seconds(1.0, 0.01), sizes=[1, 2, 3, 4]).tokens == 4
    dear = plan_step(reach, linear_seconds(1.0, 2.0), sizes=[1, 2, 3, 4])
    assert dear.plain and dear.nodes == (0,)


def test_the_cap_keeps_a_long_step_out_but_never_the_plain_step():
    reach = [[0.99] * 8]
    seconds = linear_seconds(1.0, 0.1)
    assert plan_step(reach, seconds, sizes=range(1, 10)).tokens == 9
    capped = plan_step(reach, seconds, sizes=range(1, 10), cap_seconds=1.45)
    assert capped.tokens == 5 and capped.predicted_seconds <= 1.45
    assert plan_step(reach, seconds, sizes=range(2, 10), cap_seconds=0.5).plain  # nothing fits: a plain step


def test_a_batch_is_planned_as_a_whole():
    """One copy-heavy request pays for a tree that a chat request alone would not: the plan weighs the batch."""
    seconds = linear_seconds(1.0, 0.25)
    chat = [0.2, 0.05, 0.01]
    assert plan_step([chat], seconds, sizes=[1, 2, 4]).plain
    assert not plan_step([chat, [0.95, 0.9, 0.85]], seconds, sizes=[1, 2, 4]).plain


def test_ties_go_to_the_smaller_size_and_bad_input_is_refused():
    assert plan_step([[0.0, 0.0]], lambda tokens: 1.0, sizes=[1, 2, 3]).tokens == 1
    with pytest.raises(ValueError, match="at least one request"):
        plan_step([], lambda tokens: 1.0, sizes=[1])
    with pytest.raises(ValueError, match=">= 1"):
        plan_step([[0.5]], lambda tokens: 1.0, sizes=[0, 2])


def test_a_ragged_step_gives_a_copying_request_its_tree_and_a_chatting_one_a_plain_step():
    copying, chatting = [0.95, 0.9, 0.85, 0.8, 0.75], [0.1, 0.05]
    seconds = linear_seconds(1.0, 0.05)  # a token a request costs 5% of a plain step
    plan = plan_ragged([chatting, copying, chatting, copying], seconds, sizes=range(1, 7))
    assert plan.nodes == (0, 5, 0, 5) and plan.tokens == 6
    assert plan.expected_tokens == pytest.approx(4 + 2 * sum(copying))
    assert plan.predicted_seconds == pytest.approx(seconds(1 + 10 / 4))
    # the uniform plan of the same batch pays for the chatting requests' nodes too: fewer tokens a second
    uniform = plan_step([chatting, copying, chatting, copying], seconds, sizes=range(1, 7))
    assert plan.seconds_per_token < uniform.seconds_per_token


def test_a_ragged_step_keeps_under_the_cap_and_rounds_its_width_up_to_a_size():
    reach = [[0.99] * 8, [0.99] * 8]
    seconds = linear_seconds(1.0, 0.1)
    capped = plan_ragged(reach, seconds, sizes=range(1, 10), cap_seconds=1.45)
    assert capped.predicted_seconds <= 1.45 and sum(capped.nodes) == 9  # 1 + 9 / 2 tokens a request: 1.45 s
    assert capped.nodes == (5, 4)  # equal reach: in turn, the earlier request first
    assert plan_ragged(reach, seconds, sizes=[1, 4, 9], cap_seconds=1.45).tokens == 9  # 6 tokens: the next size
    assert plan_ragged(reach, seconds, sizes=range(2, 10), cap_seconds=0.5).plain
