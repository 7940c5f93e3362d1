"""The one drafter interface: every tree shape proposes through ``TreeDrafter`` from ``DraftSources`` and returns a
``DraftTree``; ``observe`` counts exactly the children offered along the accepted path."""

import pytest

from doubles import SyntheticCandidates
from sglang_spec.errors import SpecError
from sglang_spec.tree import AcceptanceProfile, DraftSources, DraftTree, TreeDrafter, TreePolicy
from sglang_spec.tree.ngram import NgramIndex
from sglang_spec.tree.policies import CONTEXT_POLICY_NAMES, HEAD_POLICY_NAMES, POLICY_NAMES
from sglang_spec.tree.profile import SOURCE_LOOKUP, SOURCE_MTP
from sglang_spec.tree.sequoia import sequoia_plan

PROFILE = AcceptanceProfile.load(None)
CONTEXT = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5]  # repeats: the lookup has continuations to offer


def sources(name: str) -> DraftSources:
    head = None if name == "lookup" else SyntheticCandidates(vocab_size=16, seed=7)
    context = NgramIndex(CONTEXT) if name in CONTEXT_POLICY_NAMES else None
    return DraftSources(mtp=head, context=context)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_shape_proposes_one_draft_tree_type(name):
    policy = TreePolicy(name, budget=6, depth=4, topk=2 if name != "chain" else None, profile=PROFILE)
    drafted = TreeDrafter(policy).propose(CONTEXT[-1], sources(name))
    assert isinstance(drafted, DraftTree)
    count = drafted.tree.validate(max_depth=4).num_nodes
    assert 1 < count <= 7 and drafted.tree.tokens[0] == CONTEXT[-1]
    assert len(drafted.sources) == len(drafted.cells) == len(drafted.estimates) == count
    assert drafted.sources[0] == 0 and all(source != 0 for source in drafted.sources[1:])
    if name == "lookup":
        assert set(drafted.sources[1:]) == {SOURCE_LOOKUP}
    if name in HEAD_POLICY_NAMES:
        assert set(drafted.sources[1:]) == {SOURCE_MTP}
    if name == "lookup":  # the context's copy 3 4 5 6 7 follows the root 5 -> 6 7 3 4 ...
        assert drafted.tree.tokens[1:3].tolist() == [6, 7]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_shape_without_its_sources_is_one_clear_line(name):
    policy = TreePolicy(name, budget=4, depth=3, profile=PROFILE)
    with pytest.raises(SpecError) as error:
        policy.build(5, DraftSources())
    assert "\n" not in str(error.value)


def test_observe_counts_the_children_offered_along_the_accepted_path_only():
    drafter = TreeDrafter(TreePolicy("lookup", budget=8, depth=6, lookup_width=2))
    drafted = drafter.propose(5, sources("lookup"))
    parents = drafted.tree.parents.tolist()
    path = [0, 1]  # the root and its first child accepted, nothing below
    offered_at_path = [child for child in range(1, len(parents)) if parents[child] in path]
    off_path = [child for child in range(1, len(parents)) if parents[child] not in path]
    assert off_path, "the test needs a node below the accepted path"
    before = {id(cell): list(cell) for node in drafted.cells for cell in node}
    drafter.observe(drafted, path)
    counted = {id(cell): cell[1] - before[id(cell)][1] for node in drafted.cells for cell in node}
    accepted = {id(cell): cell[0] - before[id(cell)][0] for node in drafted.cells for cell in node}
    # every cell an offered child is counted in moved by one offer per such child (cells may be shared)
    for child in offered_at_path:
        assert all(counted[id(cell)] >= 1 for cell in drafted.cells[child])
    assert sum(accepted.values()) == pytest.approx(1.0)  # exactly the accepted child, once
    for child in off_path:  # a child of a rejected node was never offered at an accepted node
        if all(cell not in [c for other in offered_at_path for c in drafted.cells[other]]
               for cell in drafted.cells[child]):
            assert all(counted[id(cell)] == 0 for cell in drafted.cells[child])


def test_sequoias_static_shape_is_the_dp_tree_the_plugin_lays_out():
    policy = TreePolicy("sequoia", budget=12, depth=4, topk=3, profile=PROFILE)
    shape = policy.static_shape()
    plan = sequoia_plan(PROFILE, 12, 4, max_branch=3)
    assert shape is not None and tuple(shape.parents.tolist()) == plan.parents
    assert tuple(shape.ranks.tolist()) == plan.ranks
    built = policy.build(9, DraftSources(mtp=SyntheticCandidates(vocab_size=32, seed=1))).tree
    assert built.parents.tolist() == shape.parents.tolist()  # the decoder's tree has the same topology
    assert TreePolicy("chain", budget=9, depth=3).static_shape().parents.tolist() == [-1, 0, 1, 2]
    assert TreePolicy("specexec", budget=9, depth=3).static_shape() is None
