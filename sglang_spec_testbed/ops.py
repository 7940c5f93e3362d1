"""Stand-ins for sgl-kernel's CPU cache-location, KV-copy and speculative-tree ops (pure torch).

Each function has the signature of the op SGLang 0.5.23 calls (``sglang/kernels/ops/speculative/*.py``,
``mem_cache/allocation.py``, ``kernels/ops/kvcache/cache_move.py``, ``intel_amx_backend.py``), mutates the same
outputs, and follows the semantics of SGLang's Triton twin of the same op. Greedy tree verification walks each
request's tree on host lists, checked equal to SGLang's Triton twin (``spec_tree.verify_tree_greedy_triton``, the
XPU path), which costs tens of milliseconds a step under the Triton interpreter at 8 requests. Tree building runs
its Triton twin (``sgl_build_tree_kernel_triton``) when ``SGLANG_SPEC_CPU_TRITON_TREE=1``; by default it decodes the
draft outputs with sglang_spec's SGLang-ABI codec (``tree.encode_sglang``, checked equal to that Triton twin by the
tests), because the interpreted kernel costs seconds per step at the 32-64-node trees the plugin's own draft loop
builds. NGRAM's ``reconstruct_indices_from_tree_mask`` (links and positions of the corpus's tree, from its ancestor
mask) is plain torch, checked equal to SGLang's Triton twin (``reconstruct_tree.py``, the XPU path).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from sglang_spec_testbed.attention import BEAM_PREFIXES_ATTRIBUTE
from sglang_spec_testbed.tree_mask import first_use
from sglang_spec.tree.batch import TreeBatch
from sglang_spec.tree.encode_sglang import TreeMaskMode, parents_from_sglang_draft, verify_metadata

TRITON_TREE_FLAG = "SGLANG_SPEC_CPU_TRITON_TREE"


def _request_spans(start: torch.Tensor, end: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, length, offset into the flat output) per request: requests' spans are packed back to back."""
    lengths = (end - start).tolist()
    starts = start.tolist()
    spans, offset = [], 0
    for first, length in zip(starts, lengths):
        spans.append((int(first), int(length), offset))
        offset += int(length)
    return spans


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """req_to_token[r, start:end] = the request's packed slice of out_cache_loc."""
    for row, (first, length, offset) in zip(req_pool_indices.tolist(), _request_spans(start_offset, end_offset)):
        req_to_token[row, first:first + length] = out_cache_loc[offset:offset + length].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """The inverse gather: out_cache_loc's packed slice = req_to_token[r, start:end]."""
    for row, (first, length, offset) in zip(req_pool_indices.tolist(), _request_spans(start_offset, end_offset)):
        out_cache_loc[offset:offset + length] = req_to_token[row, first:first + length].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk,
                                           num_cols):
    """Each request's ``topk * num_cols`` draft slots, read from req_to_token from its seq_len on."""
    width = topk * num_cols
    for index, (row, length) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[index * width:(index + 1) * width] = req_to_token[row, length:length + width].to(
            out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """bonus_tokens[b] = accept_tokens.flat[b * stride + accept_lens[b] - 1] (accept_lens counts the bonus)."""
    index = torch.arange(accept_lens.shape[0], device=accept_lens.device) * accept_stride + accept_lens.long() - 1
    bonus_tokens.copy_(accept_tokens.reshape(-1)[index].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """The cache slots of the accepted nodes (accept_index, -1 padded), packed in order."""
    nodes = accept_index.reshape(-1).long()
    nodes = nodes[nodes >= 0]
    accept_out_cache_loc[: nodes.numel()] = out_cache_loc[nodes].to(accept_out_cache_loc.dtype)


# (base address, row bytes) -> a numpy view of that many rows or more: building a view through ctypes costs ~4 us,
# and a tree step moves KV in every layer's K and V buffer (60 of them for SmolLM2)
_ROW_VIEWS: dict[tuple[int, int], np.ndarray] = {}


def _rows_view(base: int, stride: int, rows: int) -> np.ndarray:
    """A uint8 view of at least ``rows`` rows of ``stride`` bytes from address ``base``. Only rows the caller names
    are ever read or written through it, so a view longer than a buffer that was since replaced is never touched
    past that buffer's rows."""
    view = _ROW_VIEWS.get((base, stride))
    if view is None or view.shape[0] < rows:
        pointer = ctypes.cast(base, ctypes.POINTER(ctypes.c_uint8))
        view = _ROW_VIEWS[(base, stride)] = np.ctypeslib.as_array(pointer, shape=(rows, stride))
    return view


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every layer buffer (base address ``data_ptrs[i]``, ``strides[i]`` bytes a row): row tgt = row src.
    All source rows are read before any is written (numpy fancy indexing copies), so overlapping moves are safe,
    like SGLang's tiled kernel; rows already in place are left out. SGLang hands raw addresses here, so the buffers
    are viewed through numpy."""
    targets = tgt_loc.long().numpy()
    sources = src_loc.long().numpy()
    moved = targets != sources
    if not moved.any():
        return
    targets, sources = targets[moved], sources[moved]
    rows = int(max(targets.max(), sources.max())) + 1
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        view = _rows_view(int(base), int(stride), rows)
        view[targets] = view[sources]


def draft_slot_starts(seq_lens: torch.Tensor, topk: int, num_steps: int, page_size: int = 1) -> torch.Tensor:
    """[bs, topk] position in each request's req_to_token row of every beam's first draft slot, as SGLang lays them
    out (``eagle_worker_common.prepare_for_draft``, read back by ``generate_draft_decode_kv_indices``): page size 1
    or a chain, the beams' columns back to back from the request's length (``seq_len + beam * num_steps``); page
    size > 1 with topk > 1, each beam its own run of whole pages from the prefix's last partial page on, its slots
    after that page's filled part (``prefix_base + beam * num_new_pages * page_size + last_page``, where the
    branch's first ``last_page`` slots hold copies of the prefix's tail)."""
    seq_lens = seq_lens.long()
    beams = torch.arange(topk, device=seq_lens.device)[None, :]
    if page_size == 1 or topk == 1:
        return seq_lens[:, None] + beams * num_steps
    last_page = seq_lens % page_size
    num_new_pages = (last_page + num_steps + page_size - 1) // page_size
    return (seq_lens - last_page)[:, None] + beams * (num_new_pages * page_size)[:, None] + last_page[:, None]


def build_draft_decode_metadata_cpu(req_to_token, req_pool_indices, seq_lens, topk, num_steps, pool_len,
                                    page_size: int = 1):
    """[bs * topk, pool_len] token tables for draft decode: row (b, beam) = request b's prefix followed by the
    beam's own draft slots (``draft_slot_starts``). sgl-kernel's CPU op has no page size (its layout is page size
    1's); ``page_size`` is bound by the bed when the draft backend is built (``patches.amx_draft_backend_init_after``)
    and reads the paged layout as SGLang's Triton twin does (``generate_draft_decode_kv_indices``: the prefix from
    the row, then the beam's slots)."""
    batch = seq_lens.shape[0]
    table = torch.zeros((batch * topk, pool_len), dtype=req_to_token.dtype, device=req_to_token.device)
    starts = draft_slot_starts(seq_lens, topk, num_steps, page_size).tolist()
    for request, (row, length) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        source = req_to_token[row]
        for beam in range(topk):
            out = table[request * topk + beam]
            out[:length] = source[:length]
            first = starts[request][beam]
            out[length:length + num_steps] = source[first:first + num_steps]
    setattr(table, BEAM_PREFIXES_ATTRIBUTE, seq_lens.tolist())  # the decode stand-in attends a request's beams once
    return table


def build_tree_kernel_efficient_cpu(parent_list, top_scores_index, seq_lens, tree_mask, positions, retrieve_index,
                                    retrieve_next_token, retrieve_next_sibling, topk, spec_steps, num_verify_tokens,
                                    tree_mask_mode):
    """Writes the tree mask in the layout ``tree_mask_mode`` names (SGLang's worker picks it:
    ``default_tree_mask_mode()``, QLEN_ONLY on a CPU unless ``SGLANG_SPEC_CPU_TREE_MASK`` says otherwise); a
    FULL_MASK's prefix columns are written True, as SGLang's caller pre-fills them."""
    first_use("built", TreeMaskMode(int(tree_mask_mode)), f"{top_scores_index.shape[0]} requests x "
                                                          f"{num_verify_tokens} tokens")
    if os.environ.get(TRITON_TREE_FLAG) == "1":
        from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton

        # the twin stops a node's walk to the root after its depth argument; the CUDA kernel walks to the root, and
        # a context tree runs deeper than its draft steps: bound the walk by the tree's size instead
        sgl_build_tree_kernel_triton(parent_list, top_scores_index, seq_lens, tree_mask, positions, retrieve_index,
                                     retrieve_next_token, retrieve_next_sibling, topk,
                                     max(spec_steps, num_verify_tokens - 1), num_verify_tokens, tree_mask_mode)
        return
    batch_size = top_scores_index.shape[0]
    # the trees' structure only, over the whole batch at once (its tokens are no output of the kernel's)
    parents = parents_from_sglang_draft(parent_list.cpu(), top_scores_index.cpu(), topk)
    batch = TreeBatch.from_parents(torch.zeros_like(parents), parents,
                                   torch.full((batch_size,), num_verify_tokens, dtype=torch.int64))
    built = verify_metadata(batch, seq_lens.cpu(), TreeMaskMode(int(tree_mask_mode)))
    tree_mask.view(-1)[: built.tree_mask.numel()].copy_(built.tree_mask.reshape(-1).to(tree_mask.dtype))
    positions.copy_(built.positions)
    retrieve_index.copy_(built.retrieve_index)
    retrieve_next_token.copy_(built.retrieve_next_token)
    retrieve_next_sibling.copy_(built.retrieve_next_sibling)


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                           retrive_next_sibling, target_predict):
    """SGLang's greedy tree verify (``spec_tree.verify_tree_greedy_triton``): the Triton twin's walk, per request on
    host lists (a tree step walks at most depth levels of a few siblings; the former vectorised form ran ~15 torch
    ops a level, ~0.5 ms at one request and 8 nodes, against tens of microseconds here).

    candidates, retrive_* [bs, n] (node ids local to the request, -1 for none; retrive_index global ids);
    target_predict [bs, n], read at global ids. Outputs, in place: predicts [bs * n] int32 (the accepted path's
    entries only), accept_index [bs, S] int32 (column 0 the root, then one accepted node per level; the rest
    untouched), accept_token_num [bs] int32. Per request, for up to S - 1 levels: the current node's children
    are scanned in sibling order (at most n of them, as the twin's bounded loop: links that cycle end the walk)
    and the first whose token equals the target's token at the current node is accepted; the walk stops at the
    first level without one. The bonus is the target's token at the last accepted node.
    """
    batch, n = candidates.shape
    if batch == 0:
        return
    levels = accept_index.shape[1]
    tokens, nodes = candidates.tolist(), retrive_index.tolist()
    first_child, next_sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    written: list[int] = []  # global ids whose predicts entry becomes the target's token there
    accepted: list[tuple[int, int, int]] = []  # (request, accept_index column, global node id)
    counts: list[int] = []
    for row in range(batch):
        last = nodes[row][0]
        accepted.append((row, 0, last))
        current = count = 0
        for level in range(1, levels):
            token = target[last]
            child = first_child[row][current]
            for _ in range(n):
                if child < 0 or tokens[row][child] == token:
                    break
                child = next_sibling[row][child]
            else:
                child = -1  # n siblings scanned without a match
            if child < 0:
                break
            written.append(last)
            last = nodes[row][child]
            accepted.append((row, level, last))
            current, count = child, count + 1
        written.append(last)
        counts.append(count)
    written_index = torch.tensor(written, dtype=torch.long, device=predicts.device)
    predicts[written_index] = target_predict.reshape(-1)[written_index].to(predicts.dtype)
    request, column, node = torch.tensor(accepted, dtype=torch.long, device=accept_index.device).unbind(1)
    accept_index[request, column] = node.to(accept_index.dtype)
    accept_token_num.copy_(torch.tensor(counts, dtype=accept_token_num.dtype))


def reconstruct_indices_from_tree_mask(tree_mask: torch.Tensor, verified_seq_len: torch.Tensor,
                                       positions: torch.Tensor, retrieve_index: torch.Tensor,
                                       retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                                       batch_size: int, draft_token_num: int) -> None:
    """NGRAM's verify metadata from its tree mask (``sgl_kernel.speculative.reconstruct_indices_from_tree_mask``;
    SGLang's Triton twin is ``reconstruct_tree.reconstruct_indices_from_tree_mask_triton``).

    ``tree_mask`` is ``[bs, n, n]`` flattened (n = draft_token_num, bool or uint8): ``mask[b, i, j]`` marks node j
    an ancestor of node i (the diagonal may be set; it is ignored). Per request b and node t, written in place:
    ``positions[b * n + t]`` = verified_seq_len[b] + the number of t's strict ancestors; ``retrieve_index[b, t]``
    = b * n + t; ``retrieve_next_token[b, t]`` = the smallest k > t with t among k's ancestors (t's first child when
    children follow their parents), else -1; ``retrieve_next_sibling[b, t]`` = the smallest k > t whose parent (its
    nearest strict ancestor, the largest such j) is t's parent, else -1, and -1 for a root (no parent).
    """
    if batch_size == 0:
        return
    n = draft_token_num
    mask = tree_mask.reshape(-1)[: batch_size * n * n].reshape(batch_size, n, n).bool()
    order = torch.arange(n, device=mask.device)
    ancestors = mask & (order[None, :] < order[:, None])  # [b, i, j]: j a strict ancestor of i
    depth = ancestors.sum(-1)
    positions.view(batch_size, n).copy_(depth + verified_seq_len[:batch_size, None].to(depth.dtype))
    retrieve_index.view(batch_size, n).copy_(torch.arange(batch_size * n, device=mask.device).view(batch_size, n))
    parent = torch.where(ancestors, order, -1).amax(-1)  # [b, i]
    first_descendant = torch.where(ancestors, order[:, None], n).amin(1)  # [b, t]: min over rows i
    retrieve_next_token.view(batch_size, n).copy_(torch.where(first_descendant < n, first_descendant, -1))
    later_with_same_parent = (parent[:, :, None] == parent[:, None, :]) & (order[:, None] > order[None, :])  # [b, k, t]
    first_sibling = torch.where(later_with_same_parent, order[:, None], n).amin(1)  # [b, t]
    retrieve_next_sibling.view(batch_size, n).copy_(torch.where((parent >= 0) & (first_sibling < n), first_sibling,
                                                                -1))


STAND_INS = {
    function.__name__: function
    for function in (
        assign_req_to_token_pool_cpu,
        assign_extend_cache_locs_cpu,
        assign_draft_cache_locs_contiguous_cpu,
        fill_bonus_tokens_cpu,
        fill_accept_out_cache_loc_cpu,
        copy_all_layer_kv_cache_cpu,
        build_draft_decode_metadata_cpu,
        build_tree_kernel_efficient_cpu,
        verify_tree_greedy_cpu,
        reconstruct_indices_from_tree_mask,
    )
}
