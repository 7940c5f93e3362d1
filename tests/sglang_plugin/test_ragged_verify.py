"""Ragged verify's pieces against the verify metadata of the real trees: a padded tree with its fillers unlinked
links as the real tree does, and its tree mask cut to the real prefix is the real tree's mask, in both unpacked
layouts; the compacted rows scatter back into SGLang's dense rows; which servers verify ragged. (Through
launch_server: the host lookup / hybrid servers of ``test_context_trees.py``, the planner matrix's cells and the MLA
cascade's lookup server, ``test_mla_tree_verify_server.py``.)"""

from __future__ import annotations

import pytest
import torch

from sglang_spec.sglang_plugin.drafters.padding import pad_to_budget
from sglang_spec.sglang_plugin.ragged_verify import (RaggedVerify, compact_mask, compacted_batch, graph_tier,
                                                     ragged_refusal, scatter_dense, tier_mask, unlink_fillers)
from sglang_spec.tree.encode_sglang import TreeMaskMode, encode_sglang_verify, tree_mask_cells
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


def _backend(name: str):
    return type(name, (), {})()


def _graphs(ragged_mode: bool):
    from types import SimpleNamespace

    return SimpleNamespace(ragged_verify_mode=ragged_mode, capture_num_tokens=[4, 8, 16],
                           _ragged_capture_slots=lambda tier: min(tier, 4))


def test_ragged_verify_runs_where_the_verify_forward_takes_per_request_lengths():
    """SGLang's CPU back-end and the plugin's MLA cascade, eager or on SGLang's ragged verify graphs, without DP
    attention, an unpacked mask; each other case is refused with its reason."""
    qlen, full, packed = TreeMaskMode.QLEN_ONLY, TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY_BITPACKING
    assert ragged_refusal(_backend("IntelAMXAttnBackend"), None, qlen, False) is None
    assert ragged_refusal(_backend("MLATreeVerifyBackend"), None, full, False) is None
    assert ragged_refusal(_backend("IntelAMXAttnBackend"), _graphs(True), qlen, False) is None
    assert "FlashInferAttnBackend takes one verify width" in ragged_refusal(_backend("FlashInferAttnBackend"), None,
                                                                            full, False)
    assert "decode graphs are captured at one verify width" in ragged_refusal(_backend("MLATreeVerifyBackend"),
                                                                              _graphs(False), full, False)
    assert "DP attention" in ragged_refusal(_backend("IntelAMXAttnBackend"), None, qlen, True)
    assert "QLEN_ONLY_BITPACKING" in ragged_refusal(_backend("IntelAMXAttnBackend"), None, packed, False)


def test_a_step_replays_the_smallest_tier_holding_its_tokens_and_requests():
    assert graph_tier(_graphs(True), RaggedVerify.of([2, 1, 3], 3, "cpu")) == 8
    assert graph_tier(_graphs(True), RaggedVerify.of([1, 1], 3, "cpu")) == 4
    assert graph_tier(_graphs(True), RaggedVerify.of([3] * 5, 3, "cpu")) is None  # 5 requests: 4 slots a tier
    assert graph_tier(_graphs(True), RaggedVerify.of([6, 6, 6], 6, "cpu")) is None  # 18 tokens: past the largest
    assert graph_tier(_graphs(False), RaggedVerify.of([1, 1], 3, "cpu")) is None  # a runner of one width
    assert graph_tier(None, RaggedVerify.of([1, 1], 3, "cpu")) is None


def test_a_forward_padded_to_its_tier_keeps_its_rows_and_scatters_back():
    from types import SimpleNamespace

    ragged = RaggedVerify.of([2, 1, 3], 3, "cpu")
    batch = SimpleNamespace(input_ids=torch.arange(10, 19), positions=torch.arange(20, 29),
                            out_cache_loc=torch.arange(30, 39), seq_lens_cpu=torch.tensor([5, 6, 7]),
                            spec_info=SimpleNamespace(custom_mask=None))
    compacted_batch(batch, ragged, TreeMaskMode.QLEN_ONLY, [4, 8, 16], 8)
    assert batch.input_ids.tolist() == [10, 11, 13, 16, 17, 18, 0, 0]  # pad tokens: id, position, KV slot 0
    assert batch.positions.tolist()[-2:] == [0, 0] and batch.out_cache_loc.tolist()[-2:] == [0, 0]
    layout = batch.spec_info.ragged_verify_layout
    assert layout.verify_lens.tolist() == [2, 1, 3] and layout.graph_num_tokens == 8
    rows = torch.arange(1.0, 9.0)[:, None]  # the tier's rows, its 2 pad rows last
    assert scatter_dense(rows, ragged)[:, 0].tolist() == [1, 2, 0, 3, 0, 0, 4, 5, 6]


@pytest.mark.parametrize("mode", [TreeMaskMode.QLEN_ONLY, TreeMaskMode.FULL_MASK])
def test_a_tier_mask_holds_each_real_block_and_hides_pad_tokens_from_real_ones(mode):
    """Slot 0 keeps its length, slot 1 (the last real one) was given 2 pad tokens by the runner's staging, slot 2 is
    a pad slot: the real blocks are the cut ones, no real token sees a pad token, pad rows see everything."""
    real = [TREES[1], TREES[2]]
    prefixes, real_lengths, lengths = [3, 12, 1], [6, 1], [6, 3, 2]
    cut = torch.cat([encode_sglang_verify([tree], [prefix], mode).tree_mask for tree, prefix in zip(real, prefixes)])
    mask = tier_mask(cut, mode, prefixes, real_lengths, lengths)
    blocks = mask.split(tree_mask_cells(mode, prefixes, lengths))
    for slot, (prefix, length) in enumerate(zip(prefixes, lengths)):
        width = (prefix if mode == TreeMaskMode.FULL_MASK else 0) + length
        block = blocks[slot].view(length, width)
        n = real_lengths[slot] if slot < len(real) else 0
        if n:
            own = encode_sglang_verify([real[slot]], [prefix], mode).tree_mask
            assert torch.equal(block[:n, :width - length + n].reshape(-1), own)
            assert not block[:n, width - length + n:].any()  # no real token sees a pad token
        assert block[n:].all()
    # a capture: every cell attends everywhere
    assert tier_mask(None, mode, prefixes, None, lengths).all()
    # a staged length shorter than the real tree is no layout of these trees
    with pytest.raises(ValueError, match="cut the trees"):
        tier_mask(cut, mode, prefixes, real_lengths, [5, 1, 2])
