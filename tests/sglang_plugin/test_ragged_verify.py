"""Ragged verify's pieces against the verify metadata of the real trees: a padded tree with its fillers unlinked
links as the real tree does, and its tree mask cut to the real prefix is the real tree's mask, in both unpacked
layouts; the compacted rows scatter back into SGLang's dense rows; which servers verify ragged. (Through
launch_server: the host lookup / hybrid servers of ``test_context_trees.py``, the planner matrix's cells and the MLA
cascade's lookup server, ``test_mla_tree_verify_server.py``.)"""

from __future__ import annotations

import pytest
import torch

from sglang_spec.sglang_plugin.drafters.padding import pad_to_budget
from sglang_spec.sglang_plugin.ragged_verify import (RaggedVerify, compact_mask, ragged_refusal, scatter_dense,
                                                     unlink_fillers)
from sglang_spec.tree.encode_sglang import TreeMaskMode, encode_sglang_verify
from sglang_spec.tree.token_tree import TokenTree

WIDTH, STEPS, BUDGET = 3, 4, 9
# real trees: a chain, a bushy one, the root alone (a plain request inside a tree step)
TREES = [TokenTree.from_parents([-1, 0, 1, 2], tokens=[5, 6, 7, 8]),
         TokenTree.from_parents([-1, 0, 0, 1, 1, 2], tokens=[5, 9, 3, 4, 2, 7]),
         TokenTree.from_parents([-1], tokens=[5])]
PREFIXES = [7, 3, 12]


def _real_links(tree: TokenTree, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    real = encode_sglang_verify([tree], [prefix])
    pad = BUDGET + 1 - len(tree.parents)
    return (torch.nn.functional.pad(real.retrieve_next_token[0], (0, pad), value=-1),
            torch.nn.functional.pad(real.retrieve_next_sibling[0], (0, pad), value=-1))


def test_unlinked_fillers_leave_each_real_tree_linked_as_it_is_alone():
    padded = [pad_to_budget(tree, BUDGET, WIDTH, STEPS) for tree in TREES]
    dense = encode_sglang_verify(padded, PREFIXES)
    lengths = torch.tensor([len(tree.parents) for tree in TREES])
    children, siblings = unlink_fillers(dense.retrieve_next_token, dense.retrieve_next_sibling, lengths)
    for row, (tree, prefix) in enumerate(zip(TREES, PREFIXES)):
        real_children, real_siblings = _real_links(tree, prefix)
        assert torch.equal(children[row], real_children)
        assert torch.equal(siblings[row], real_siblings)
    # negative control: the padded links do reach fillers
    assert not torch.equal(dense.retrieve_next_token, children)


@pytest.mark.parametrize("mode", [TreeMaskMode.QLEN_ONLY, TreeMaskMode.FULL_MASK])
def test_a_cut_mask_is_each_real_trees_own(mode):
    padded = [pad_to_budget(tree, BUDGET, WIDTH, STEPS) for tree in TREES]
    dense = encode_sglang_verify(padded, PREFIXES, mode)
    lengths = [len(tree.parents) for tree in TREES]
    cut = compact_mask(dense.tree_mask, mode, PREFIXES, BUDGET + 1, lengths)
    real = torch.cat([encode_sglang_verify([tree], [prefix], mode).tree_mask for tree, prefix in zip(TREES, PREFIXES)])
    assert torch.equal(cut, real)


def test_packed_masks_stay_dense():
    with pytest.raises(ValueError, match="not cut per request"):
        compact_mask(torch.zeros(4), TreeMaskMode.QLEN_ONLY_BITPACKING, [1], 2, [1])


def test_compacted_rows_scatter_back_to_their_dense_rows_and_bad_lengths_are_refused():
    ragged = RaggedVerify.of([2, 1, 3], 3, "cpu")
    assert ragged.rows.tolist() == [0, 1, 3, 6, 7, 8] and ragged.total == 6 and not ragged.dense
    values = torch.arange(1.0, 7.0)[:, None].expand(6, 2)
    dense = scatter_dense(values, ragged)
    assert dense[:, 0].tolist() == [1, 2, 0, 3, 0, 0, 4, 5, 6]
    assert RaggedVerify.of([3, 3], 3, "cpu").dense
    with pytest.raises(ValueError, match="verify lengths are 1..3"):
        RaggedVerify.of([0, 4], 3, "cpu")


def _runner(backend: str, graphs: bool = False):
    from types import SimpleNamespace

    return SimpleNamespace(attn_backend=type(backend, (), {})(), decode_cuda_graph_runner=object() if graphs else None)


def test_ragged_verify_runs_where_the_verify_forward_takes_per_request_lengths():
    """SGLang's CPU back-end and the plugin's MLA cascade, eager, without DP attention, an unpacked mask; each other
    case is refused with its reason."""
    qlen, full, packed = TreeMaskMode.QLEN_ONLY, TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY_BITPACKING
    assert ragged_refusal(_runner("IntelAMXAttnBackend"), qlen, False) is None
    assert ragged_refusal(_runner("MLATreeVerifyBackend"), full, False) is None
    assert "FlashInferAttnBackend takes one verify width" in ragged_refusal(_runner("FlashInferAttnBackend"), full,
                                                                            False)
    assert "decode graphs" in ragged_refusal(_runner("MLATreeVerifyBackend", graphs=True), full, False)
    assert "DP attention" in ragged_refusal(_runner("IntelAMXAttnBackend"), qlen, True)
    assert "QLEN_ONLY_BITPACKING" in ragged_refusal(_runner("IntelAMXAttnBackend"), packed, False)
