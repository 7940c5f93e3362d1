import itertools

import numpy as np
import pytest
import torch

from doubles import SyntheticCandidates
from sglang_spec.errors import SpecError
from sglang_spec.tree import AcceptanceProfile, TreePolicy, sequoia_plan
from sglang_spec.tree.proposal import DraftSources

PROFILE = AcceptanceProfile.from_obj({"rank_acceptance": [[0.55, 0.2, 0.1, 0.05], [0.45, 0.2, 0.1]]})


class CountingSource(SyntheticCandidates):
    """Counts expansion rounds (one batched drafter call each) and expanded nodes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0
        self.expanded = 0

    def expand(self, tree, node_ids, k):
        self.calls += 1
        self.expanded += len(node_ids)
        return super().expand(tree, node_ids, k)


@pytest.mark.parametrize("name", ["chain", "eagle", "sequoia", "specexec"])
@pytest.mark.parametrize("budget, depth", [(1, 1), (4, 2), (12, 4), (30, 6), (6, 9)])
def test_every_policy_respects_budget_depth_and_tree_invariants(name, budget, depth):
    policy = TreePolicy(name, budget=budget, depth=depth, profile=PROFILE)
    source = SyntheticCandidates(vocab_size=64, seed=budget * 31 + depth)
    tree = policy.build(5, DraftSources(mtp=source)).tree.validate(max_depth=depth)
    assert tree.tokens[0] == 5
    assert tree.budget == (min(budget, depth) if name == "chain" else budget)
    # every node's token and draft prob are its parent's rank-r candidate
    for node in range(1, tree.num_nodes):
        path = [int(t) for t in tree.tokens[tree.path(node)[:-1]]]
        distribution = source.distribution(path)
        rank = int(tree.ranks[node])
        assert int(torch.argsort(distribution, descending=True, stable=True)[rank]) == int(tree.tokens[node])
        assert float(tree.draft_probs[node]) == pytest.approx(float(distribution[tree.tokens[node]]), rel=1e-6)


def test_chain_uses_one_drafter_call_per_depth():
    source = CountingSource(vocab_size=50, seed=3)
    tree = TreePolicy("chain", budget=10, depth=4).build(1, DraftSources(mtp=source)).tree
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3] and source.calls == 4
    assert tree.ranks.tolist() == [-1, 0, 0, 0, 0]


def test_sequoia_instantiates_the_dp_topology_with_top_ranks():
    source = CountingSource(vocab_size=80, seed=11)
    policy = TreePolicy("sequoia", budget=20, depth=5, profile=PROFILE)
    tree = policy.build(9, DraftSources(mtp=source)).tree
    plan = sequoia_plan(PROFILE, 20, 5)
    assert tuple(tree.parents.tolist()) == plan.parents
    assert tuple(tree.ranks.tolist()) == plan.ranks
    assert source.calls <= 5  # one batched call per level with children
    assert PROFILE.expected_accept_length(tree) == pytest.approx(plan.expected_accept_length, rel=1e-6)


def brute_force_top_paths(source, root, topk, depth, budget):
    """Every node reachable with top-k branching up to ``depth``, scored by float32 cumulative probability."""
    scored = []
    frontier = [((root,), 1.0)]
    for _ in range(depth):
        next_frontier = []
        for path, prob in frontier:
            probs, tokens = torch.topk(source.distribution(list(path)), topk)
            for p, t in zip(probs.tolist(), tokens.tolist()):
                child = (path + (t,), float(np.float32(prob) * np.float32(p)))
                scored.append(child)
                next_frontier.append(child)
        frontier = next_frontier
    scored.sort(key=lambda item: -item[1])
    return {path for path, _ in scored[:budget]}


@pytest.mark.parametrize("seed, topk, depth, budget", [(0, 3, 4, 10), (1, 2, 5, 25), (2, 4, 3, 40), (3, 3, 4, 1)])
def test_specexec_selects_the_global_top_budget_nodes(seed, topk, depth, budget):
    source = CountingSource(vocab_size=40, seed=seed, sharpness=2.0)
    tree = TreePolicy("specexec", budget=budget, depth=depth, topk=topk).build(7, DraftSources(mtp=source)).tree
    paths = {tuple(int(t) for t in tree.tokens[tree.path(node)]) for node in range(1, tree.num_nodes)}
    assert paths == brute_force_top_paths(source, 7, topk, depth, budget)
    # the selection threshold only rises, so each round adds one level at most
    assert source.calls <= depth + 1


def test_eagle_frontier_is_the_best_k_of_the_k_squared_expansions():
    source = SyntheticCandidates(vocab_size=30, seed=5, sharpness=1.5)
    tree = TreePolicy("eagle", budget=8, depth=3, topk=2).build(0, DraftSources(mtp=source)).tree
    # depth-2 nodes all hang below the two depth-1 nodes, and depth-3 nodes below the best-scoring depth-2 pair
    assert set(tree.depths.tolist()) <= {0, 1, 2, 3}
    assert tree.budget == 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="bogus", budget=4, depth=2), "unknown tree policy 'bogus'"),
        (dict(name="chain", budget=0, depth=2), "budget must be >= 1"),
        (dict(name="chain", budget=2000, depth=2), "exceeds the maximum 1023"),
        (dict(name="chain", budget=4, depth=0), "depth must be >= 1"),
        (dict(name="chain", budget=4, depth=65), "exceeds the maximum depth 64"),
        (dict(name="sequoia", budget=4, depth=2), "needs an acceptance profile"),
        (dict(name="eagle", budget=30, depth=2, topk=3), "only 12 candidate slots"),
        (dict(name="specexec", budget=4, depth=2, topk=0), "topk must be >= 1"),
    ],
)
def test_bad_policy_options_get_one_clear_line(kwargs, message):
    with pytest.raises(SpecError, match=message) as error:
        TreePolicy(**kwargs)
    assert "\n" not in str(error.value)


@pytest.mark.sglang
def test_eagle_matches_sglangs_own_draft_selection(sglang_eagle):
    """Our eagle policy and SGLang's select_top_k_tokens + organize_draft_results, on the same draft
    distributions, choose the same tree (decoded from SGLang's outputs with its own parent rule)."""
    from sglang_spec.tree import decode_sglang_draft

    for seed, (topk, steps, num_draft_tokens, batch) in itertools.product(
        range(3), [(2, 3, 6, 1), (4, 4, 12, 3), (3, 2, 10, 2), (1, 5, 6, 2), (4, 1, 4, 1), (2, 4, 15, 2), (3, 3, 19, 2)]
    ):
        # flat distributions and budgets near the slot count select deep nodes from several beams, so the
        # beam order (which fixes SGLang's slot order) matters
        source = SyntheticCandidates(vocab_size=50, seed=100 + seed, sharpness=1.0)
        roots = list(range(3, 3 + batch))
        parent_list, top_scores_index, draft_tokens = sglang_eagle.run(source, roots, topk, steps, num_draft_tokens)
        theirs = decode_sglang_draft(parent_list, top_scores_index, draft_tokens, torch.tensor(roots), topk)
        for root, their_tree in zip(roots, theirs):
            ours = TreePolicy("eagle", budget=num_draft_tokens - 1, depth=steps,
                              topk=topk).build(root, DraftSources(mtp=source)).tree
            assert ours.parents.tolist() == their_tree.parents.tolist()
            assert ours.tokens.tolist() == their_tree.tokens.tolist()
            assert ours.ranks.tolist() == their_tree.ranks.tolist()
