"""Best-first trees (the lookup and hybrid shapes of TreePolicy): lookup and head candidates in one tree under one
budget, with calibrated estimates from the profile's per-source counts."""

import json
import math

import pytest
import torch

from doubles import SyntheticCandidates
from sglang_spec.errors import SpecError
from sglang_spec.tree.candidates import CandidateSource, Candidates
from sglang_spec.costs import CostCurve
from sglang_spec.tree.proposal import DraftSources
from sglang_spec.tree.drafter import TreeDrafter
from sglang_spec.tree.ngram import NgramIndex
from sglang_spec.tree.policies import TreePolicy
from sglang_spec.tree.profile import (
    PRIOR_WEIGHT,
    SOURCE_BOTH,
    SOURCE_LOOKUP,
    SOURCE_MTP,
    AcceptanceProfile,
    SourceCounts,
)

VOCAB = 40


class RecordingSource(CandidateSource):
    """A stand-in head (seeded, path-keyed) that checks what the MTP drafter needs: every node it expands is the
    root or a child of a node it expanded before (the head's feedback state exists only for those)."""

    def __init__(self, sharpness=3.0):
        self.synthetic = SyntheticCandidates(VOCAB, seed=1, sharpness=sharpness)
        self.expanded = {0}
        self.calls = []
        self.depth_of = {}

    def expand(self, tree, node_ids, k):
        for node in node_ids:
            assert node == 0 or tree.parents[node] in self.expanded, (
                "expanded a node whose parent the head never ran on")
            self.depth_of[node] = tree.depths[node]
        self.calls.append(list(node_ids))
        self.expanded.update(node_ids)
        return self.synthetic.expand(tree, node_ids, k)


def copy_context():
    """A context that repeats a phrase, so the lookup has a long match to copy."""
    phrase = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    return NgramIndex([1, 2, *phrase, 3, 4, 5, *phrase[:4]], max_ngram=8)


def check_tree(built, policy, context, source):
    tree = built.tree
    assert 1 <= tree.num_nodes <= policy.budget + 1 and tree.depth <= policy.depth
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    assert all(0 <= parents[i] < i for i in range(1, len(parents)))
    children = {}
    for node in range(1, len(parents)):
        key = (parents[node], tokens[node])
        assert key not in children, "two siblings carry the same token"
        children[key] = node
    for node in range(1, len(parents)):
        path = tree.path(node)
        tail = [tokens[n] for n in path[1:-1]]  # tokens below the root, up to the parent
        lookup = [c.token for c in context.continuations(tail, policy.lookup_width)]
        if built.sources[node] & SOURCE_LOOKUP:
            assert tokens[node] in lookup
        else:
            assert tokens[node] not in lookup
        if built.sources[node] & SOURCE_MTP:
            assert source is not None
        assert 0 < built.estimates[node] <= 1
    assert built.sources[0] == 0 and built.cells[0] == ()
    reach = [1.0] * len(parents)
    for node in range(1, len(parents)):
        reach[node] = reach[parents[node]] * built.estimates[node]
    assert built.expected_accept_length == pytest.approx(sum(reach))


def test_lookup_tree_copies_the_context_and_never_calls_a_head():
    context = copy_context()
    policy = TreePolicy("lookup", budget=8, depth=8)
    built = policy.build(14, DraftSources(mtp=RecordingSource(), context=context), SourceCounts.generic())
    check_tree(built, policy, context, None)
    assert set(built.sources[1:]) == {SOURCE_LOOKUP} and built.mtp_forwards == 0
    # the best path is the copy of the phrase after "7 8 9 10"
    tokens = built.tree.tokens.tolist()
    chain = [tokens[node]
             for node in built.tree.path(max(range(built.tree.num_nodes), key=lambda n: built.tree.depths[n]))]
    assert chain[1:5] == [11, 12, 13, 14]


@pytest.mark.parametrize("levels", [0, 1, 3])
def test_hybrid_tree_mixes_both_sources_under_one_budget(levels):
    context = copy_context()
    source = RecordingSource()
    policy = TreePolicy("hybrid", budget=12, depth=6, mtp_levels=levels, topk=3)
    built = policy.build(14, DraftSources(mtp=source, context=context), SourceCounts.generic())
    check_tree(built, policy, context, source)
    assert built.tree.num_nodes == 13
    assert SOURCE_LOOKUP in built.sources or SOURCE_BOTH in built.sources
    assert any(s & SOURCE_MTP for s in built.sources)
    assert built.mtp_forwards == len(source.calls) - 1 <= levels  # the root's candidates are free


def test_a_token_both_sources_propose_is_one_node_rated_by_the_both_cell():
    context = NgramIndex([5, 6, 5, 6, 5], max_ngram=4)  # the lookup says 6 after 5

    class Agrees(CandidateSource):
        def expand(self, tree, node_ids, k):
            tokens = torch.tensor([[6, 9, 10][:k]] * len(node_ids))
            return Candidates(tokens=tokens, probs=torch.tensor([[0.5, 0.3, 0.1][:k]] * len(node_ids)))

    calibration = SourceCounts.generic()
    built = TreePolicy("hybrid", budget=3, depth=1, mtp_levels=0, topk=3).build(
        5, DraftSources(mtp=Agrees(), context=context), calibration)
    tokens = built.tree.tokens.tolist()
    both = tokens.index(6)
    assert built.sources[both] == SOURCE_BOTH and tokens.count(6) == 1
    assert built.cells[both][0] is calibration.both_cell(3)
    assert built.estimates[both] == calibration.estimate(calibration.both_cell(3))


def costs(verify_scale):
    sizes = [1, 2, 4, 8, 16, 32]
    return CostCurve({n: 0.03 * (1 + verify_scale * (n - 1)) for n in sizes}, draft_level=0.003,
                     step_overhead=0.001, prefix=300, device="synthetic", plain_token=0.03)


def test_adaptive_budget_follows_the_cost_curve():
    context = copy_context()
    calibration = SourceCounts.generic()
    cheap = TreePolicy("hybrid", budget=16, depth=8, mtp_levels=2, costs=costs(0.001))
    dear = TreePolicy("hybrid", budget=16, depth=8, mtp_levels=2, costs=costs(1.0))
    assert cheap.build(14, DraftSources(mtp=RecordingSource(), context=context), calibration).tree.num_nodes > 8
    # verifying a token costs as much as a plain step: no tree pays, a plain step (the root alone) is chosen
    assert dear.build(14, DraftSources(mtp=RecordingSource(), context=context), calibration).tree.num_nodes == 1


def test_calibration_counts_json_and_online_updates(tmp_path):
    calibration = SourceCounts.generic(max_ngram=4)
    cell = calibration.lookup_cell(9, 0)  # match lengths past max_ngram share the last row
    assert cell is calibration.lookup[3][0]
    before = calibration.estimate(cell)
    for _ in range(50):
        calibration.observe(cell, True)
    assert calibration.estimate(cell) > before and calibration.estimate(cell) < 1
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"rank_acceptance": [0.5], "sources": calibration.to_obj()}))
    loaded = AcceptanceProfile.from_json(path).sources
    assert loaded is not None
    assert loaded.lookup[3][0][1] == PRIOR_WEIGHT  # a loaded prior is capped so online counts can move it
    assert math.isclose(loaded.estimate(loaded.lookup[3][0]), calibration.estimate(cell))
    copy = loaded.copy()
    copy.observe(copy.lookup[0][0], False)
    assert copy.lookup[0][0] != loaded.lookup[0][0]


@pytest.mark.parametrize(
    "obj, message",
    [
        ({"lookup": []}, "not a per-source calibration"),
        ({"lookup": [[[1, 2]] * 4], "mtp": [], "both": [[1, 2]], "mtp_top1": []}, "expected lookup"),
        ({"lookup": [[[3, 2]] * 4], "mtp": [[[1, 2]] * 10] * 3, "both": [[1, 2]], "mtp_top1": [[1, 2]] * 3},
         "need 0 <= accepted <= offered"),
    ],
)
def test_bad_calibrations_are_one_line_errors(obj, message):
    with pytest.raises(SpecError, match=message):
        SourceCounts.from_obj(obj)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="suffix", budget=4, depth=4), "unknown tree policy"),
        (dict(name="hybrid", budget=0, depth=4), "budget must be >= 1"),
        (dict(name="hybrid", budget=4, depth=0), "depth must be >= 1"),
        (dict(name="hybrid", budget=4, depth=4, max_ngram=33), "max_ngram must be in"),
        (dict(name="sequoia", budget=4, depth=4, profile=AcceptanceProfile.load(None),
              costs=CostCurve({1: 1.0, 2: 1.0}, draft_level=0.1, step_overhead=0.0, prefix=1, device="x")),
         "sized once"),
        (dict(name="hybrid", budget=4, depth=4, lookup_width=5), "lookup_width must be in"),
        (dict(name="hybrid", budget=4, depth=4, mtp_levels=-1), "mtp_levels must be >= 0"),
    ],
)
def test_bad_policies(kwargs, message):
    with pytest.raises(SpecError, match=message):
        TreePolicy(**kwargs)


def test_a_policy_and_its_profiles_counts_must_agree_on_the_match_length():
    profile = AcceptanceProfile.load(None).with_sources(SourceCounts.generic(max_ngram=4))
    with pytest.raises(SpecError, match="matches up to 4 tokens"):
        TreeDrafter(TreePolicy("lookup", 4, 4, max_ngram=8, profile=profile))


@pytest.mark.parametrize("width", [1, 2, 3])
def test_a_width_bounds_children_and_head_rounds(width):
    """With a width (SGLang's static draft width), no node keeps more than ``width`` children and no head round
    expands more than ``width`` nodes, all of one depth (the round's number); without one, the tree is wider."""
    context = copy_context()
    source = RecordingSource(sharpness=1.0)
    policy = TreePolicy("hybrid", budget=16, depth=5, topk=4, width=width, mtp_levels=3)
    built = policy.build(16, DraftSources(mtp=source, context=context))
    check_tree(built, policy, context, source)
    children = [len(kids) for kids in built.tree.children()]
    assert max(children) <= width
    for level, nodes in enumerate(source.calls):
        assert len(nodes) <= width
        assert all(source.depth_of[node] == level for node in nodes)
    unbounded = TreePolicy("hybrid", budget=16, depth=5, topk=4, mtp_levels=3).build(
        16, DraftSources(mtp=RecordingSource(sharpness=1.0), context=copy_context()))
    assert max(len(kids) for kids in unbounded.tree.children()) > width



def flat_costs(round_seconds, rest=0.05):
    """A server's prices (``sglang_plugin/level_costs``): every node count verifies in the same time (SGLang pads
    each tree to its budget); only a head round costs more."""
    return CostCurve({1: rest, 1 << 20: rest}, draft_level=round_seconds, step_overhead=0.0, prefix=0,
                     device="served")


def grown(drafter, root, context, costs):
    builder = drafter.propose_rounds(root, context, costs)
    rounds, source = builder.rounds(), RecordingSource()
    try:
        nodes = next(rounds)
        while True:
            nodes = rounds.send(source.expand(builder.tree, nodes, drafter.policy.effective_topk))
    except StopIteration as done:
        return builder, done.value


def test_a_head_level_runs_only_where_the_context_leaves_it_room():
    """Priced levels (a server's ``costs``): a head round at a tenth of the step's rest. Below a long copy, whose
    context children hold nearly all of the acceptance, no head level pays; without a copy every level does.
    (Without the room the copies leave, the copy's first level was predicted to pay: caught here.)"""
    policy = TreePolicy("hybrid", budget=12, depth=6, mtp_levels=3, width=4)
    drafter = TreeDrafter(policy)
    for match in range(1, 9):  # long copies are accepted: their children leave the head little to add
        for _ in range(200):
            drafter.counts.observe(drafter.counts.lookup_cell(match, 0), True)
    builder, tree = grown(drafter, 11, copy_context(), flat_costs(0.005))
    assert builder.mtp_forwards == 0 and builder.priced_out
    assert tree.expected_accept_length > 5  # the copy's chain
    fresh = NgramIndex(list(range(100, 119)), max_ngram=8)  # tokens the head never proposes: no copies
    builder, _ = grown(drafter, 119, fresh, flat_costs(0.005))
    assert builder.mtp_forwards == policy.mtp_levels and not builder.priced_out
    builder, _ = grown(drafter, 119, fresh, flat_costs(0.05))  # a round as dear as the rest of the step
    assert builder.mtp_forwards < policy.mtp_levels and builder.priced_out
    builder, _ = grown(drafter, 119, fresh, None)  # unpriced: the policy's levels
    assert builder.mtp_forwards == policy.mtp_levels and not builder.priced_out
