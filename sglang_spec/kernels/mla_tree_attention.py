"""MLA tree attention, the tree part: every tree query against its ancestors among its own request's tree rows.

FlashInfer's MLA kernels take no custom mask, so MLA tree verify runs as a cascade
(``sglang_spec.attention.cascade``): the tree's queries attend to each request's cached prefix with FlashInfer's
batched paged MLA decode (no mask: every prefix row is visible to every tree node), and to their ancestors inside
the tree with this kernel; the two partial states merge by log-sum-exp (FlashInfer's ``merge_state``). The tree
part is small (N <= 64 rows a request) but masked, which is exactly what the FlashInfer kernels cannot do.

MLA in absorbed form: every head scores ``q_latent . c_kv + q_rope . k_rope`` against one shared latent row per
tree token and reads ``c_kv`` as the value; the output stays in latent space. Shapes: T tree tokens in the batch
(request b's are rows ``qo_indptr[b] .. qo_indptr[b + 1]``), H heads, L latent width (DeepSeek-V3: 512), R rope
width (64).

The log-sum-exp comes out in **base 2**, as FlashInfer's kernels report it (``merge_state`` merges base-2 states),
so the two halves of the cascade merge without a conversion. A query that sees no tree row (impossible for a valid
tree: a node sees itself) gets a zero output and lse = -inf, so the merge keeps the prefix half alone.

The ancestor mask is read in place from the layout SGLang built (``TreeMaskLayout``): ``QLEN_ONLY`` (per request
an ``n x n`` block) or ``FULL_MASK`` (per request ``n x (prefix + n)``, the tree's columns after the prefix's); the
layout's offsets are computed on the device (no host read), so a captured graph replays them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_spec.attention.cascade import mla_attention
from sglang_spec.tree.encode_sglang import TreeMaskMode

LOG2_E = 1.0 / math.log(2.0)


@dataclass(frozen=True, eq=False)
class TreeMaskLayout:
    """Where request b's ``n_b x n_b`` ancestor block sits in a flat tree mask (all [B] int64, on the device):
    cell (i, j) (query i sees tree row j) is ``mask[start[b] + i * row_stride[b] + column[b] + j]``.

    QLEN_ONLY: start = sum of n_c * n_c before b, row_stride = n_b, column = 0.
    FULL_MASK: start = sum of n_c * (prefix_c + n_c) before b, row_stride = prefix_b + n_b, column = prefix_b."""

    start: torch.Tensor
    row_stride: torch.Tensor
    column: torch.Tensor


def tree_mask_layout(mode: TreeMaskMode, prefix_lens: torch.Tensor, tree_lens: torch.Tensor) -> TreeMaskLayout:
    """The layout of a mask SGLang built in ``mode``; prefix_lens, tree_lens: [B] (committed tokens, tree tokens
    of each request). Device ops only."""
    prefix_lens, tree_lens = prefix_lens.to(torch.int64), tree_lens.to(torch.int64)
    if mode == TreeMaskMode.QLEN_ONLY:
        row_stride, column = tree_lens, torch.zeros_like(tree_lens)
    elif mode == TreeMaskMode.FULL_MASK:
        row_stride, column = prefix_lens + tree_lens, prefix_lens
    else:
        raise ValueError(f"the tree part reads QLEN_ONLY or FULL_MASK tree masks, not {mode.name}")
    cells = tree_lens * row_stride
    start = torch.cumsum(cells, dim=0) - cells  # exclusive prefix sum
    return TreeMaskLayout(start, row_stride, column)


@triton.jit
def _mla_tree_attention_kernel(
    q_latent_ptr,  # [T, H, L] absorbed queries (token stride q_latent_token, head stride q_latent_head)
    q_rope_ptr,  # [T, H, R] rope part of the queries
    c_kv_ptr,  # [T, L] the tree's latent rows (row stride c_kv_row), also the values
    k_rope_ptr,  # [T, R] the tree's rope keys
    qo_indptr_ptr,  # [B + 1] int32 first tree row of each request
    mask_ptr,  # flat tree mask, nonzero = attend (bool / uint8)
    mask_start_ptr,  # [B] int64 offset of request b's block (TreeMaskLayout)
    mask_row_stride_ptr,  # [B] int64
    mask_column_ptr,  # [B] int64
    out_ptr,  # out [T, H, L] (token stride out_token, head stride out_head)
    lse_ptr,  # out [T, H] float32, base 2 (token stride lse_token)
    q_latent_token,
    q_latent_head,
    q_rope_token,
    q_rope_head,
    c_kv_row,
    k_rope_row,
    out_token,
    out_head,
    lse_token,
    num_heads,
    scale_log2,  # softmax scale * log2(e): scores in base 2
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # tree queries a program
    BLOCK_H: tl.constexpr,  # heads a program; BLOCK_Q * BLOCK_H >= 16 (tl.dot's smallest M)
    BLOCK_N: tl.constexpr,  # >= the most tree tokens a request has
    BLOCK_L: tl.constexpr,  # latent columns per chunk; divides LATENT
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs (tl.dot would round them to tf32), else "tf32"
):
    # program (b, query block, head block): queries [qb * BLOCK_Q, ...) of request b x heads [hb * BLOCK_H, ...),
    # as BLOCK_Q * BLOCK_H rows (row r: query r // BLOCK_H, head r % BLOCK_H) that share one read of the tree's rows
    b = tl.program_id(0)
    query_block = tl.program_id(1)
    head_block = tl.program_id(2)
    first = tl.load(qo_indptr_ptr + b)
    count = tl.load(qo_indptr_ptr + b + 1) - first
    if query_block * BLOCK_Q < count:
        row = tl.arange(0, BLOCK_Q * BLOCK_H)
        query = query_block * BLOCK_Q + row // BLOCK_H
        head = head_block * BLOCK_H + row % BLOCK_H
        live = (query < count) & (head < num_heads)
        token = first.to(tl.int64) + query
        keys = tl.arange(0, BLOCK_N)
        in_tree = keys < count
        tree_rows = first.to(tl.int64) + keys
        mask_rows = (tl.load(mask_start_ptr + b) + query * tl.load(mask_row_stride_ptr + b)
                     + tl.load(mask_column_ptr + b))
        visible = tl.load(mask_ptr + mask_rows[:, None] + keys[None, :], mask=live[:, None] & in_tree[None, :],
                          other=0) != 0  # [rows, BLOCK_N]

        # scores [rows, BLOCK_N] = q_latent . c_kv + q_rope . k_rope, latent chunk by chunk
        scores = tl.zeros((BLOCK_Q * BLOCK_H, BLOCK_N), dtype=tl.float32)
        columns = tl.arange(0, BLOCK_L)
        q_rows = q_latent_ptr + token * q_latent_token + head * q_latent_head
        for chunk in range(0, LATENT, BLOCK_L):
            q = tl.load(q_rows[:, None] + (chunk + columns)[None, :], mask=live[:, None], other=0.0)
            k = tl.load(c_kv_ptr + tree_rows[:, None] * c_kv_row + (chunk + columns)[None, :],
                        mask=in_tree[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), scores, input_precision=DOT_PRECISION)
        rope_columns = tl.arange(0, ROPE_PAD)
        in_rope = rope_columns < ROPE
        q_rope = tl.load(q_rope_ptr + (token * q_rope_token + head * q_rope_head)[:, None] + rope_columns[None, :],
                         mask=live[:, None] & in_rope[None, :], other=0.0)
        k_rope = tl.load(k_rope_ptr + tree_rows[:, None] * k_rope_row + rope_columns[None, :],
                         mask=in_tree[:, None] & in_rope[None, :], other=0.0)
        scores = tl.dot(q_rope, tl.trans(k_rope), scores, input_precision=DOT_PRECISION)

        # softmax in base 2 over the visible rows; an all-masked row keeps max -inf: weights 0, lse -inf
        scores = tl.where(visible, scores * scale_log2, float("-inf"))
        row_max = tl.max(scores, axis=1)
        safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        weights = tl.exp2(scores - safe_max[:, None])
        total = tl.sum(weights, axis=1)
        lse = safe_max + tl.log2(total)
        tl.store(lse_ptr + token * lse_token + head, lse, mask=live)
        weights = weights / tl.where(total == 0.0, 1.0, total)[:, None]

        # out [rows, L] = weights @ c_kv, chunk by chunk (the values are the latent rows themselves)
        out_rows = out_ptr + token * out_token + head * out_head
        for chunk in range(0, LATENT, BLOCK_L):
            values = tl.load(c_kv_ptr + tree_rows[:, None] * c_kv_row + (chunk + columns)[None, :],
                             mask=in_tree[:, None], other=0.0)
            attended = tl.dot(weights.to(values.dtype), values, input_precision=DOT_PRECISION)
            tl.store(out_rows[:, None] + (chunk + columns)[None, :], attended.to(out_ptr.dtype.element_ty),
                     mask=live[:, None])


def _check(q_latent, q_rope, tree_c_kv, tree_k_rope, qo_indptr, layout, out, lse) -> None:
    tokens, heads, latent = q_latent.shape
    rope = q_rope.shape[-1]
    if q_rope.shape[:2] != (tokens, heads):
        raise ValueError(f"q_rope must be [T, H, R] = [{tokens}, {heads}, R], got {tuple(q_rope.shape)}")
    if tree_c_kv.shape != (tokens, latent) or tree_k_rope.shape != (tokens, rope):
        raise ValueError(f"tree rows must be c_kv [T, L] = [{tokens}, {latent}] and k_rope [T, R] = "
                         f"[{tokens}, {rope}], got {tuple(tree_c_kv.shape)} and {tuple(tree_k_rope.shape)}")
    if out.shape != q_latent.shape or lse.shape != (tokens, heads) or lse.dtype != torch.float32:
        raise ValueError(f"out must be [T, H, L] {tuple(q_latent.shape)} and lse float32 [T, H] = [{tokens}, {heads}]")
    for name, tensor in (("q_latent", q_latent), ("q_rope", q_rope), ("tree_c_kv", tree_c_kv),
                         ("tree_k_rope", tree_k_rope), ("out", out), ("lse", lse)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous")
    batch = qo_indptr.shape[0] - 1
    if any(field.shape != (batch,) for field in (layout.start, layout.row_stride, layout.column)):
        raise ValueError(f"the mask layout must have one entry per request ({batch})")


def mla_tree_attention(
    q_latent: torch.Tensor, q_rope: torch.Tensor, tree_c_kv: torch.Tensor, tree_k_rope: torch.Tensor,
    qo_indptr: torch.Tensor, mask: torch.Tensor, layout: TreeMaskLayout, max_tree_tokens: int, scale: float,
    out: torch.Tensor, lse: torch.Tensor, block_heads: int = 16, block_latent: int = 64, block_rows: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher. q_latent [T, H, L], q_rope [T, H, R]; tree_c_kv [T, L], tree_k_rope [T, R] (row t: the latent row
    of tree token t); qo_indptr [B + 1] int32; mask: flat, read through ``layout``; max_tree_tokens: the most tree
    tokens any request has (host int, fixed per captured shape); scale: the softmax scale. Writes out [T, H, L] and
    lse [T, H] float32 (base 2) and returns them, as FlashInfer's ``run(..., return_lse=True)`` does."""
    _check(q_latent, q_rope, tree_c_kv, tree_k_rope, qo_indptr, layout, out, lse)
    tokens, heads, latent = q_latent.shape
    if tokens == 0:
        return out, lse
    block_latent = min(block_latent, triton.next_power_of_2(latent))
    if latent % block_latent:
        raise ValueError(f"the latent width {latent} must be a multiple of {block_latent}")
    # rows of a program: BLOCK_Q queries x BLOCK_H heads, at least 16 (tl.dot) and about ``block_rows``; queries of
    # one block share each read of their request's tree rows
    block_heads = min(block_heads, triton.next_power_of_2(heads))
    queries_wanted = min(triton.next_power_of_2(max_tree_tokens), max(1, block_rows // block_heads))
    block_queries = max(16 // block_heads, queries_wanted)
    grid = (qo_indptr.shape[0] - 1, triton.cdiv(max_tree_tokens, block_queries), triton.cdiv(heads, block_heads))
    _mla_tree_attention_kernel[grid](
        q_latent, q_rope, tree_c_kv, tree_k_rope, qo_indptr, mask, layout.start, layout.row_stride, layout.column,
        out, lse,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), tree_c_kv.stride(0),
        tree_k_rope.stride(0), out.stride(0), out.stride(1), lse.stride(0),
        heads, scale * LOG2_E,
        LATENT=latent,
        ROPE=q_rope.shape[-1],
        ROPE_PAD=max(16, triton.next_power_of_2(q_rope.shape[-1])),
        BLOCK_Q=block_queries,
        BLOCK_H=block_heads,
        BLOCK_N=max(16, triton.next_power_of_2(max_tree_tokens)),
        BLOCK_L=block_latent,
        # float32 attention is exact float32, as the reference and a float32 server's other attention: a compiled
        # tl.dot rounds float32 inputs to tf32 by default (about 3e-4 relative on a GPU; the interpreter does not)
        DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
    )
    return out, lse


def mla_tree_attention_reference(
    q_latent: torch.Tensor, q_rope: torch.Tensor, tree_c_kv: torch.Tensor, tree_k_rope: torch.Tensor,
    qo_indptr: torch.Tensor, mask: torch.Tensor, layout: TreeMaskLayout, max_tree_tokens: int, scale: float,
    out: torch.Tensor, lse: torch.Tensor, block_heads: int = 16, block_latent: int = 64, block_rows: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The launcher's contract in plain torch, one request at a time (``cascade.mla_attention`` over the request's
    tree rows with its ancestor block), lse converted to base 2. Reads the host: a reference, not a graph path."""
    _check(q_latent, q_rope, tree_c_kv, tree_k_rope, qo_indptr, layout, out, lse)
    bounds = qo_indptr.tolist()
    starts, strides, columns = layout.start.tolist(), layout.row_stride.tolist(), layout.column.tolist()
    for b in range(len(bounds) - 1):
        first, count = bounds[b], bounds[b + 1] - bounds[b]
        if count == 0:
            continue
        if count > max_tree_tokens:
            raise ValueError(f"request {b} has {count} tree tokens, more than max_tree_tokens {max_tree_tokens}")
        cells = torch.arange(count, device=mask.device)
        index = starts[b] + cells[:, None] * strides[b] + columns[b] + cells[None, :]
        block = mask.reshape(-1)[index] != 0  # [n, n]
        rows = slice(first, first + count)
        state = mla_attention(q_latent[rows].float(), q_rope[rows].float(), tree_c_kv[rows].float(),
                              tree_k_rope[rows].float(), scale, mask=block)
        out[rows] = state.out.to(out.dtype)
        lse[rows] = state.lse * LOG2_E
    return out, lse
