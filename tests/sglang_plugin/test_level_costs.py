"""Tree auto's head-level prices (``sglang_plugin/level_costs``): measured on served tree steps per batch-size
bucket, given to the tree builder as a curve whose step time is the served step's again."""

import math

from sglang_spec.sglang_plugin.level_costs import LevelCosts
from sglang_spec.costs import step_seconds


def test_no_curve_until_a_round_and_a_step_are_measured():
    costs = LevelCosts()
    assert costs.curve(1) is None
    costs.observe(1, 0.050, rounds=0, rounds_seconds=0.0)  # a step that ran no head round prices no round
    assert costs.curve(1) is None
    costs.observe(1, 0.056, rounds=2, rounds_seconds=0.006)
    assert costs.curve(1) is not None and costs.curve(3) is None  # 3 is in the next bucket (3-4)


def test_the_curve_gives_the_served_step_back_at_any_node_count():
    costs = LevelCosts()
    costs.observe(4, 0.060, rounds=2, rounds_seconds=0.008)  # batch 4's bucket: rounds of 4 ms, 52 ms besides
    curve = costs.curve(3)
    assert math.isclose(curve.draft_level, 0.004)
    for nodes in (1, 8, 64, 1000):  # SGLang verifies the padded budget whatever the tree: flat in the nodes
        # the builder charges its levels and the commit forward (the draft extend, inside the 52 ms)
        assert math.isclose(step_seconds(curve, nodes, 2 + 1), 0.060)
    costs.observe(4, 0.060, rounds=1, rounds_seconds=0.010)  # moving averages: the newest weighs 0.3
    assert math.isclose(costs.curve(4).draft_level, 0.7 * 0.004 + 0.3 * 0.010)
    assert "head round 5.8 ms" in costs.describe(4)


def test_a_rest_shorter_than_a_round_is_priced_at_one_round():
    costs = LevelCosts()
    costs.observe(1, 0.010, rounds=3, rounds_seconds=0.009)  # timer noise: 1 ms besides three 3 ms rounds
    curve = costs.curve(1)
    assert curve.verify[1] == curve.draft_level > 0
