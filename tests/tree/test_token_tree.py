import pytest
import torch

from sglang_spec.errors import SpecError
from sglang_spec.tree import TokenTree, TreeBatch


def test_from_parents_fills_depths_and_sibling_ranks():
    tree = TokenTree.from_parents([-1, 0, 0, 1, 1, 3], tokens=[9, 10, 11, 12, 13, 14])
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 3]
    assert tree.ranks.tolist() == [-1, 0, 1, 0, 1, 0]
    assert tree.budget == 5 and tree.depth == 3
    assert tree.children() == [[1, 2], [3, 4], [], [5], [], []]
    assert tree.path(5) == [0, 1, 3, 5]


def test_ancestor_mask_is_root_ancestors_and_self():
    tree = TokenTree.from_parents([-1, 0, 0, 1, 3])
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(tree.ancestor_mask(), expected)


@pytest.mark.parametrize(
    "parents, message",
    [
        ([], "at least its root"),
        ([0, 0], "root and must have parent -1"),
        ([-1, 0, -1], "only the root"),
        ([-1, 0, 7], "outside the tree"),
        ([-1, 2, 1], "cycle through nodes 1 -> 2 -> 1"),
        ([-1, 1], "cycle through nodes 1 -> 1"),
        ([-1, 2, 0], "parents-first order"),
    ],
)
def test_bad_parents_get_one_clear_line(parents, message):
    with pytest.raises(SpecError, match=message) as error:
        TokenTree.from_parents(parents)
    assert "\n" not in str(error.value)


def test_depth_over_the_maximum_is_rejected():
    with pytest.raises(SpecError, match="tree depth 3 exceeds the maximum depth 2"):
        TokenTree.from_parents([-1, 0, 1, 2], max_depth=2)


def test_duplicate_sibling_tokens_and_ranks_are_rejected():
    with pytest.raises(SpecError, match="sibling tokens must be distinct"):
        TokenTree.from_parents([-1, 0, 0], tokens=[1, 5, 5])
    with pytest.raises(SpecError, match="sibling ranks must be distinct"):
        TokenTree.from_parents([-1, 0, 0], ranks=[-1, 1, 1])


def test_validate_catches_inconsistent_depths_and_probabilities():
    tree = TokenTree.from_parents([-1, 0, 1])
    broken = TokenTree(tree.tokens, tree.parents, torch.tensor([0, 1, 1]), tree.ranks, tree.draft_probs)
    with pytest.raises(SpecError, match="depths must grow by 1"):
        broken.validate()
    bad_probs = TokenTree(tree.tokens, tree.parents, tree.depths, tree.ranks, torch.tensor([1.0, 1.5, 0.2]))
    with pytest.raises(SpecError, match="draft_probs"):
        bad_probs.validate()


def test_tree_batch_pads_and_links_children_like_sglang():
    first = TokenTree.from_parents([-1, 0, 0, 1], tokens=[5, 6, 7, 8])
    second = TokenTree.from_parents([-1, 0], tokens=[3, 4])
    batch = TreeBatch.from_trees([first, None, second], max_nodes=5)
    assert batch.num_nodes.tolist() == [4, 0, 2]
    assert batch.tokens.tolist() == [[5, 6, 7, 8, -1], [-1] * 5, [3, 4, -1, -1, -1]]
    assert batch.first_child[0].tolist() == [1, 3, -1, -1, -1]
    assert batch.next_sibling[0].tolist() == [-1, 2, -1, -1, -1]
    assert batch.parents[1].tolist() == [-1] * 5
    with pytest.raises(SpecError, match="at most 3 per request"):
        TreeBatch.from_trees([first], max_nodes=3)
