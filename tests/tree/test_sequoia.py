"""The Sequoia DP against exhaustive enumeration, the published reference values and Sequoia's demo tree."""

import functools
import json
import math

import numpy as np
import pytest

from paths import DATA_DIR
from sglang_spec.errors import SpecError
from sglang_spec.tree import AcceptanceProfile, TokenTree, choose_tree_size, sequoia_plan, sequoia_table
from sglang_spec.costs import CostCurve

MAX_NODES = 12  # budget <= 11
MAX_LEVELS = 7  # depth <= 6


@functools.lru_cache(maxsize=None)
def ordered_trees(num_nodes: int) -> tuple:
    """Every ordered (plane) tree with num_nodes nodes, as a tuple of child subtrees."""
    return tuple(forest for forest in ordered_forests(num_nodes - 1))


@functools.lru_cache(maxsize=None)
def ordered_forests(num_nodes: int) -> tuple:
    if num_nodes == 0:
        return ((),)
    result = []
    for first in range(1, num_nodes + 1):
        for tree in ordered_trees(first):
            for rest in ordered_forests(num_nodes - first):
                result.append((tree,) + rest)
    return tuple(result)


def tree_height(tree: tuple) -> int:
    return 1 + max((tree_height(child) for child in tree), default=0)


def tree_width_ok(tree: tuple, max_branch: int) -> bool:
    return len(tree) <= max_branch and all(tree_width_ok(child, max_branch) for child in tree)


def expected_length(tree: tuple, matrix: np.ndarray, depth: int = 0) -> float:
    """F(T) in float64: 1 + sum_i p^(depth+1)[i] * F(child_i)."""
    row = matrix[min(depth, len(matrix) - 1)]
    return 1.0 + sum(row[rank] * expected_length(child, matrix, depth + 1) for rank, child in enumerate(tree))


def random_profiles():
    rng = np.random.default_rng(7)
    profiles = []
    for max_rank, per_depth in [(3, False), (4, False), (2, True), (4, True), (5, False)]:
        rows = []
        for _ in range(4 if per_depth else 1):
            values = rng.dirichlet(np.full(max_rank + 1, 0.7))[:max_rank]
            rows.append([float(v) for v in values])
        profiles.append(AcceptanceProfile.from_obj({"rank_acceptance": rows if per_depth else rows[0]}))
    # non-monotone ranks, from the reference notes
    profiles.append(AcceptanceProfile.uniform([0.5, 0.05, 0.2, 0.1]))
    return profiles


@pytest.mark.parametrize("profile", random_profiles(), ids=lambda p: f"rank{p.max_rank}x{p.num_rows}")
def test_dp_equals_exhaustive_enumeration(profile):
    matrix = profile.matrix(MAX_LEVELS)
    best = {}  # (nodes, height) -> best F among trees of exactly that height
    for num_nodes in range(1, MAX_NODES + 1):
        for tree in ordered_trees(num_nodes):
            if not tree_width_ok(tree, profile.max_rank):
                continue
            key = (num_nodes, tree_height(tree))
            best[key] = max(best.get(key, -math.inf), expected_length(tree, matrix))
    for levels in range(1, MAX_LEVELS + 1):
        table = sequoia_table(profile, MAX_NODES, levels)
        for num_nodes in range(1, MAX_NODES + 1):
            exhaustive = max(
                (value for (n, height), value in best.items() if n == num_nodes and height <= levels),
                default=-math.inf,
            )
            dp = table.best_value(num_nodes)
            if exhaustive == -math.inf:
                assert dp == -math.inf, (num_nodes, levels)
                continue
            assert dp == pytest.approx(exhaustive, rel=2e-6), (num_nodes, levels)
            # the reconstructed tree achieves the DP's value and respects the limits
            parents = table.parents(num_nodes)
            tree = TokenTree.from_parents(parents)
            assert tree.num_nodes == num_nodes and tree.depth <= levels - 1
            assert max(len(c) for c in tree.children()) <= profile.max_rank
            assert profile.expected_accept_length(tree) == pytest.approx(dp, rel=2e-6)


def load_sequoia_vector() -> AcceptanceProfile:
    data = json.loads((DATA_DIR / "sequoia" / "acceptance_vector.json").read_text())
    return AcceptanceProfile.uniform(data["p_used_by_dp"][1:])


def test_reference_table_values():
    profile = load_sequoia_vector()
    expected = {
        4: [2.1443, 2.2914, 2.2914, 2.2914, 2.2914, 2.2914],
        8: [2.3743, 2.5933, 2.6980, 2.7322, 2.7322, 2.7322],
        16: [2.5207, 2.8645, 3.0126, 3.0876, 3.1303, 3.1303],
        32: [2.6256, 3.0560, 3.3047, 3.4123, 3.4896, 3.5007],
        64: [2.7071, 3.2230, 3.5261, 3.7017, 3.8240, 3.8523],
        128: [2.7582, 3.3548, 3.7358, 3.9577, 4.1512, 4.1921],
    }
    for levels_index, levels in enumerate([3, 4, 5, 6, 8, 10]):
        table = sequoia_table(profile, 128, levels)
        for num_nodes, row in expected.items():
            assert round(table.best_value(num_nodes), 4) == pytest.approx(row[levels_index], abs=1e-4)


def test_worked_optima_from_the_reference_notes():
    profile = load_sequoia_vector()
    plan = sequoia_plan(profile, budget=7, depth=3)
    assert plan.parents == (-1, 0, 0, 0, 1, 1, 2, 4)
    assert plan.expected_accept_length == pytest.approx(2.5933, abs=1e-4)
    plan16 = sequoia_plan(profile, budget=15, depth=4)
    tree = TokenTree.from_parents(plan16.parents)
    assert np.bincount(tree.depths.numpy()).tolist() == [1, 3, 5, 4, 3]
    small = AcceptanceProfile.uniform([0.6, 0.2, 0.1, 0.05])
    # growmap branches [[2], [1, 0], [1], [0]] from the reference notes
    assert sequoia_plan(small, budget=4, depth=5).parents == (-1, 0, 0, 1, 3)
    assert sequoia_plan(small, budget=4, depth=5).expected_accept_length == pytest.approx(2.376, abs=1e-4)
    assert sequoia_plan(small, budget=3, depth=1).expected_accept_length == pytest.approx(1.9, abs=1e-6)
    sharp = AcceptanceProfile.uniform([0.9, 0.05, 0.02, 0.01])
    assert sequoia_plan(sharp, budget=4, depth=5).parents == (-1, 0, 1, 2, 3)


def test_reproduces_sequoias_demo_tree():
    config = json.loads((DATA_DIR / "sequoia" / "demo_config.json").read_text())
    demo = json.loads((DATA_DIR / "sequoia" / "demo_tree.json").read_text())
    profile = load_sequoia_vector()
    # Sequoia charges depth + 1 draft passes and no host work: our step cost with an overhead of one draft level
    costs = CostCurve(verify=dict(zip(config["valid_budget"], config["target_time"])), draft_level=config["draft_time"],
                      step_overhead=config["draft_time"], prefix=0, device="Sequoia's demo")
    choice = choose_tree_size(profile, costs, max_depth=config["max_depth"] - 1, allow_no_speculation=False)
    assert (choice.budget + 1, choice.depth + 1) == (4, 4)
    assert choice.expected_accept_length == pytest.approx(2.2914, abs=1e-4)
    assert choice.time_per_token == pytest.approx(4.888, abs=1e-3)
    assert choice.speedup == pytest.approx(2.046, abs=1e-3)
    plan = sequoia_plan(profile, choice.budget, choice.depth)
    tree = TokenTree.from_parents(plan.parents)
    assert plan.parents == tuple([-1] + [p for p, kids in enumerate(demo["Successors"]) for _ in kids])
    assert tree.children() == demo["Successors"]
    assert tree.depths.tolist() == demo["depth"]
    assert tree.ancestor_mask().int().tolist() == demo["mask"]
    assert tree.num_nodes == demo["size"]


def test_hardware_choice_can_decline_speculation():
    profile = AcceptanceProfile.uniform([0.3, 0.05])
    # verifying more tokens costs as much as decoding them one by one: no tree can pay
    costs = CostCurve({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}, draft_level=0.2, step_overhead=0.2, prefix=0, device="toy")
    choice = choose_tree_size(profile, costs, max_depth=4)
    assert choice.budget == 0 and choice.speedup == 1.0


def test_infeasible_budget_is_a_clear_error():
    narrow = AcceptanceProfile.uniform([0.8])  # one child per node: a chain only
    with pytest.raises(SpecError, match="no tree with 5 draft nodes fits depth 3"):
        sequoia_plan(narrow, budget=5, depth=3)
