import numpy as np
import pytest
import torch

from helpers import random_tree
from sglang_spec.errors import SpecError
from sglang_spec.tree import (
    TokenTree,
    TreeMaskMode,
    decode_sglang_draft,
    encode_sglang_draft,
    encode_sglang_verify,
)

UNO_EXAMPLE = TokenTree.from_parents([-1, 0, 0, 0, 1, 1, 4], tokens=[50, 51, 52, 53, 54, 55, 56])


def test_uno_example_from_the_reference_notes():
    encoding = encode_sglang_draft([UNO_EXAMPLE], topk=3, spec_steps=3)
    assert encoding.top_scores_index.tolist() == [[0, 1, 2, 3, 4, 12]]
    assert encoding.parent_list.tolist() == [[-1, 0, 1, 2, 3, 4, -1]]
    meta = encode_sglang_verify([UNO_EXAMPLE], seq_lens=[10], mode=TreeMaskMode.QLEN_ONLY)
    assert meta.positions.tolist() == [10, 11, 11, 11, 12, 12, 13]
    assert meta.retrieve_next_token.tolist() == [[1, 4, -1, -1, 6, -1, -1]]
    assert meta.retrieve_next_sibling.tolist() == [[-1, 2, 3, -1, 5, -1, -1]]
    rows = ["1000000", "1100000", "1010000", "1001000", "1100100", "1100010", "1100101"]
    assert ["".join(str(int(v)) for v in row) for row in meta.tree_mask.reshape(7, 7).tolist()] == rows
    assert meta.draft_tokens.tolist() == [50, 51, 52, 53, 54, 55, 56]


def test_bitpacked_rows_are_little_endian():
    meta = encode_sglang_verify([UNO_EXAMPLE], seq_lens=[3], mode=TreeMaskMode.QLEN_ONLY_BITPACKING)
    # row 6 attends to 0, 1, 4, 6 -> 0b1010011 = 83; row 1,1,0,1 -> 11 as in the environment notes
    assert meta.tree_mask.dtype == torch.uint8
    assert meta.tree_mask.tolist() == [1, 3, 5, 9, 19, 35, 83]
    wide = TokenTree.from_parents([-1] + [0] * 9 + [9])  # 11 nodes -> 2 bytes per row
    packed = encode_sglang_verify([wide], [0], TreeMaskMode.QLEN_ONLY_BITPACKING).tree_mask
    assert packed.dtype == torch.uint16 and int(packed[10]) == 1 + (1 << 9) + (1 << 10)
    with pytest.raises(SpecError, match="at most 32 tree tokens"):
        encode_sglang_verify([TokenTree.from_parents([-1] + [0] * 33)], [0], TreeMaskMode.QLEN_ONLY_BITPACKING)


def test_full_mask_has_true_prefix_columns_then_tree_columns():
    tree = TokenTree.from_parents([-1, 0, 1])
    mask = encode_sglang_verify([tree, tree], seq_lens=[2, 1]).tree_mask
    first = mask[: 3 * 5].reshape(3, 5)
    second = mask[3 * 5 :].reshape(3, 4)
    assert first[:, :2].all() and second[:, :1].all()
    assert torch.equal(first[:, 2:], tree.ancestor_mask()) and torch.equal(second[:, 1:], tree.ancestor_mask())


def test_encoder_limits_get_one_clear_line():
    star = TokenTree.from_parents([-1, 0, 0, 0])
    with pytest.raises(SpecError, match="more than topk=2 children"):
        encode_sglang_draft([star], topk=2, spec_steps=2)
    chain = TokenTree.from_parents([-1, 0, 1, 2])
    with pytest.raises(SpecError, match="tree depth 3 exceeds the accepted path's 2 draft tokens"):
        encode_sglang_draft([chain], topk=1, spec_steps=2)
    with pytest.raises(SpecError, match="tree depth 3 exceeds the accepted path's 2 draft tokens"):
        encode_sglang_draft([chain], topk=1, spec_steps=3, accept_depth=2)
    # a context tree's accept bound past SGLang's draft steps: the parent_list (topk 2, 2 steps: 3 entries) holds
    # its parents 0..2
    assert encode_sglang_draft([chain], topk=2, spec_steps=2, accept_depth=3).parent_list.shape == (1, 3)
    with pytest.raises(SpecError, match="parent_list holds only 5 entries"):
        encode_sglang_draft([TokenTree.from_parents([-1, 0, 0, 1, 1, 2, 2, 6])], topk=2, spec_steps=3)
    with pytest.raises(SpecError, match="pad every tree to one budget"):
        encode_sglang_draft([star, TokenTree.from_parents([-1, 0])], topk=4, spec_steps=2)


def random_batches():
    """Irregular batches: non-power-of-two sizes, chains, stars, deep and bushy trees, up to 32 nodes."""
    rng = np.random.default_rng(2024)
    cases = []
    for batch_size, num_nodes, topk, spec_steps, depth in [
        (1, 2, 1, 1, 1),
        (3, 5, 1, 4, 4),  # chains
        (1, 9, 8, 2, 2),  # star
        (5, 8, 2, 7, 7),
        (2, 16, 4, 5, 5),
        (3, 13, 3, 6, 6),
        (1, 32, 4, 8, 8),
        (7, 6, 3, 3, 3),
        (4, 12, 6, 3, 11),  # context trees: deeper than SGLang's draft steps (hybrid 11 / width 6 in 3 steps)
        (2, 9, 2, 5, 8),
    ]:
        trees = []
        for _ in range(batch_size):
            # parents must stay below the parent_list width topk*(spec_steps-1)+1
            while True:
                tree = random_tree(rng, num_nodes, max_fanout=topk, max_depth=depth)
                if all(p < topk * (spec_steps - 1) + 1 for p in tree.parents.tolist()):
                    break
            trees.append(tree)
        seq_lens = torch.from_numpy(rng.integers(1, 20, size=batch_size)).long()
        cases.append((trees, seq_lens, topk, spec_steps, depth))
    return cases


@pytest.mark.sglang
@pytest.mark.parametrize("mode", [TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY])
@pytest.mark.parametrize("case", random_batches(), ids=lambda c: f"bs{len(c[0])}n{c[0][0].num_nodes}")
def test_conforms_to_sglangs_triton_build_tree_kernel(sglang_kernels, case, mode):
    trees, seq_lens, topk, spec_steps, depth = case
    encoding = encode_sglang_draft(trees, topk=topk, spec_steps=spec_steps, accept_depth=depth)
    built = sglang_kernels.build_tree(encoding, seq_lens, mode)
    ours = encode_sglang_verify(trees, seq_lens, mode)
    assert torch.equal(built.positions, ours.positions)
    assert torch.equal(built.retrieve_index, ours.retrieve_index)
    assert torch.equal(built.retrieve_next_token, ours.retrieve_next_token)
    assert torch.equal(built.retrieve_next_sibling, ours.retrieve_next_sibling)
    assert torch.equal(built.tree_mask, ours.tree_mask)
    if mode == TreeMaskMode.QLEN_ONLY and trees[0].num_nodes <= 32:
        # SGLang's Triton twin has no bit-packing; pack its QLEN_ONLY rows and compare with ours
        n = trees[0].num_nodes
        packed = encode_sglang_verify(trees, seq_lens, TreeMaskMode.QLEN_ONLY_BITPACKING).tree_mask
        rows = built.tree_mask.reshape(-1, n).numpy()
        width = packed.element_size()
        expected = np.packbits(np.pad(rows, ((0, 0), (0, 8 * width - n))), axis=1, bitorder="little")
        assert packed.view(torch.uint8).reshape(-1, width).numpy().tolist() == expected.tolist()
    # and SGLang's parent rule decodes our encoding back into the same trees
    decoded = decode_sglang_draft(
        encoding.parent_list, encoding.top_scores_index, encoding.draft_tokens, encoding.bonus_tokens, topk
    )
    for tree, back in zip(trees, decoded):
        assert back.parents.tolist() == tree.parents.tolist() and back.tokens.tolist() == tree.tokens.tolist()


@pytest.mark.parametrize("mode", [TreeMaskMode.QLEN_ONLY, TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY_BITPACKING])
def test_a_mask_built_before_dp_padding_is_completed_for_the_padding_rows(mode):
    """DP attention pads a verify batch of one request to two after the mask was built: the real request's block
    stays as built, the padding row's block lets it attend everywhere."""
    from sglang_spec.tree.encode_sglang import complete_tree_mask, tree_mask_cells

    built = encode_sglang_verify([UNO_EXAMPLE], seq_lens=[10], mode=mode).tree_mask
    completed = complete_tree_mask(built, mode, prefix_lens=[10, 1], tree_lens=[7, 7])
    cells = tree_mask_cells(mode, [10, 1], [7, 7])
    assert completed.numel() == sum(cells) and completed.dtype == built.dtype
    assert torch.equal(completed[:built.numel()], built)
    padding = completed[built.numel():]
    expected_fill = (1 << (8 * built.element_size())) - 1 if mode == TreeMaskMode.QLEN_ONLY_BITPACKING else True
    assert padding.tolist() == [expected_fill] * cells[1]
    # a mask long enough (SGLang sizes some by an upper bound) is the same tensor
    assert complete_tree_mask(completed, mode, [10, 1], [7, 7]) is completed


def test_a_mask_that_covers_no_leading_run_of_requests_is_refused():
    """A QLEN_ONLY mask read as FULL_MASK falls short in the middle of a block: refused, not padded; and a missing
    mask is never made attend-everything (that would let every tree token see its siblings)."""
    from sglang_spec.tree.encode_sglang import complete_tree_mask

    qlen = encode_sglang_verify([UNO_EXAMPLE, UNO_EXAMPLE], seq_lens=[10, 12], mode=TreeMaskMode.QLEN_ONLY).tree_mask
    with pytest.raises(ValueError, match="built in another mode"):
        complete_tree_mask(qlen, TreeMaskMode.FULL_MASK, [10, 12], [7, 7])
    with pytest.raises(ValueError, match="built in another mode"):
        complete_tree_mask(torch.zeros(0, dtype=torch.bool), TreeMaskMode.QLEN_ONLY, [10, 1], [7, 7])


def test_a_draft_whose_parent_is_not_selected_or_comes_late_is_refused_in_one_line():
    """SGLang's parent rule over draft outputs that encode no tree: a parent slot naming a value no node holds, a
    slot past the parent_list, a parent after its child. The UNO example itself decodes (the control)."""
    from sglang_spec.tree.encode_sglang import parents_from_sglang_draft

    encoding = encode_sglang_draft([UNO_EXAMPLE], topk=3, spec_steps=3)
    parent_list, top_scores_index = encoding.parent_list, encoding.top_scores_index
    assert parents_from_sglang_draft(parent_list, top_scores_index, 3).tolist() == [UNO_EXAMPLE.parents.tolist()]
    unselected = parent_list.clone()
    unselected[0, 4] = 40  # node 6's parent slot 4 now names a value no node holds
    past = top_scores_index.clone()
    past[0, 5] = 7 * 3  # slot 7 of a 7-entry parent_list
    late = top_scores_index.clone()
    late[0, 0] = 3 * 3  # node 1's parent slot 3 names node 3's value: a parent after its child
    late_list = parent_list.clone()
    late_list[0, 1] = 3 * 3  # slot 1 still names node 1 (nodes 4 and 5 keep their parent)
    for lists, scores, message in ((unselected, top_scores_index, "parent slot is not selected"),
                                   (parent_list, past, "past its parent_list"),
                                   (late_list, late, "comes after it")):
        with pytest.raises(SpecError, match=message) as error:
            parents_from_sglang_draft(lists, scores, 3)
        assert "\n" not in str(error.value)
