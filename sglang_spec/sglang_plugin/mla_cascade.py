"""MLA tree verify on FlashInfer: planning, paging and the cascade (prefix by FlashInfer's MLA decode, tree by
``kernels.mla_tree_attention``, merged by ``merge_state``). No sglang here: the SGLang back-end
(``sglang_plugin.mla_tree_backend``) feeds it SGLang's tables and pools.

The split (``attention/cascade.py`` states the identity): request b verifies n tree tokens after p_b committed
ones. Every tree query sees all p_b prefix rows, so the prefix half is a plain batched MLA decode with n queries a
request (``causal=False``, kv_len = p_b): FlashInfer's paged MLA kernel, no mask needed. The tree half is an
n x n ancestor-masked attention over the tree's own latent rows (just written to the cache at the tree's slots).
FlashInfer reports both halves' lse in base 2, and so does the tree kernel, for ``merge_state``.

``flashinfer`` below is a namespace with FlashInfer's ``BatchMLAPagedAttentionWrapper``, ``MLAPlanMetadata`` and
``merge_state``: the real package on a GPU, the CPU twin (``attention/flashinfer_mla.py``, same signatures
and layouts) on the CPU bed and in the tests.

Paging: SGLang's MLA pool is [slots, 1, L + R] with slot = page * page_size + offset; FlashInfer reads it as
[pages, page_size, L] / [pages, page_size, R] and request b's prefix as the pages of its first p_b positions
(``req_to_token[row, 0::page_size] // page_size``), the last one partly.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch

from sglang_spec.kernels.mla_tree_attention import TreeMaskLayout, mla_tree_attention, tree_mask_layout
from sglang_spec.tree.encode_sglang import TreeMaskMode


def flashinfer_package_namespace() -> SimpleNamespace:
    """The real FlashInfer's MLA wrapper, plan metadata and merge (a GPU; the CPU twin's ``namespace()`` has the
    same three names)."""
    import flashinfer  # optional: a CUDA package
    from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

    return SimpleNamespace(BatchMLAPagedAttentionWrapper=BatchMLAPagedAttentionWrapper,
                           MLAPlanMetadata=MLAPlanMetadata, merge_state=flashinfer.merge_state)


@dataclass(frozen=True, eq=False)
class MLATreeVerifyPlan:
    """One verify batch's metadata, shared by every layer: B requests, request b verifying n_b <= n tree tokens
    (n_b = n everywhere but in a ragged verify), T = sum(n_b) rows.

    Device tensors (built without a host read):
      qo_indptr:  [B + 1] int32, cumulative n_b: request b's tree queries.
      kv_indptr:  [B + 1] int32, cumulative pages of the prefixes (ceil(p_b / page_size) each).
      kv_indices: [B * max_pages] int32, the prefix pages, request after request from kv_indptr[b]; the tail past
                  kv_indptr[B] is unread padding (a fixed-size buffer keeps a captured graph's address).
      kv_lens:    [B] int32, p_b.
      mask_layout: where each request's n x n ancestor block sits in SGLang's tree mask.
    Host tensors (what FlashInfer's plan schedules from; taken from SGLang's host copy of the prefix lengths):
      qo_indptr_host, kv_indptr_host [B + 1], kv_lens_host [B] int32.
    tree_tokens: n, the most tree tokens a request verifies; page_size: tokens per KV page."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor
    mask_layout: TreeMaskLayout
    qo_indptr_host: torch.Tensor
    kv_indptr_host: torch.Tensor
    kv_lens_host: torch.Tensor
    tree_tokens: int
    page_size: int

    @property
    def batch_size(self) -> int:
        return self.kv_lens.shape[0]


def _pages(lengths: torch.Tensor, page_size: int) -> torch.Tensor:
    return (lengths + page_size - 1) // page_size


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    indptr = torch.zeros(counts.shape[0] + 1, dtype=torch.int32, device=counts.device)
    indptr[1:] = torch.cumsum(counts, dim=0)
    return indptr


def prefix_page_indices(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, kv_indptr: torch.Tensor,
    page_size: int, max_pages: int, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The prefix pages of every request, packed after kv_indptr (device ops, no host read). req_to_token
    [rows, context] int32/int64 slots; req_pool_indices [B]; prefix_lens [B]; kv_indptr [B + 1]; max_pages: a host
    bound on any request's page count (pages past a request's count are routed to a dump cell). Returns out
    [>= B * max_pages] int32 (allocated when None)."""
    batch = req_pool_indices.shape[0]
    capacity = batch * max_pages
    if out is None:
        out = torch.zeros(capacity, dtype=torch.int32, device=req_to_token.device)
    if out.shape[0] < capacity:
        raise ValueError(f"kv_indices holds {out.shape[0]} pages, {batch} requests x {max_pages} need {capacity}")
    if capacity == 0:
        return out
    page = torch.arange(max_pages, device=req_to_token.device)
    first_slots = req_to_token[req_pool_indices.long()][:, : max_pages * page_size : page_size]  # [B, <= max_pages]
    if first_slots.shape[1] < max_pages:  # a bound past the rows' width (a graph's capacity): never used pages
        first_slots = torch.nn.functional.pad(first_slots, (0, max_pages - first_slots.shape[1]))
    used = page[None, :] < _pages(prefix_lens.long(), page_size)[:, None]
    target = torch.where(used, kv_indptr[:-1, None].long() + page[None, :], capacity)  # unused -> the dump cell
    staged = torch.zeros(capacity + 1, dtype=torch.int32, device=out.device)
    staged.scatter_(0, target.reshape(-1), (first_slots // page_size).to(torch.int32).reshape(-1))
    out[:capacity].copy_(staged[:capacity])
    return out


def plan_tree_verify(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
    prefix_lens_host: torch.Tensor, tree_tokens: int, page_size: int, mask_mode: TreeMaskMode,
    kv_indices_out: torch.Tensor | None = None, max_pages: int | None = None,
    tree_lens: Sequence[int] | None = None,
) -> MLATreeVerifyPlan:
    """The plan for B requests verifying ``tree_tokens`` each (or, ragged, ``tree_lens[b]`` <= tree_tokens: host
    ints; 0 for a ragged verify graph's pad slot past its tier's tokens) after ``prefix_lens`` [B] (device) /
    ``prefix_lens_host`` [B] (host copy, what SGLang keeps as seq_lens_cpu). ``mask_mode``: the layout of the tree
    mask SGLang built (cut to ``tree_lens`` where ragged).
    max_pages defaults to the batch's largest page count (from the host copy)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    lengths = [tree_tokens] * prefix_lens.shape[0] if tree_lens is None else [int(n) for n in tree_lens]
    if len(lengths) != prefix_lens.shape[0] or any(n < 0 or n > tree_tokens for n in lengths):
        raise ValueError(f"tree_lens are 0..{tree_tokens} for each of {prefix_lens.shape[0]} requests, got {lengths}")
    device = req_to_token.device
    batch = prefix_lens.shape[0]
    prefix_lens_host = prefix_lens_host.to(device="cpu", dtype=torch.int32)
    if max_pages is None:
        max_pages = int(_pages(prefix_lens_host, page_size).max()) if batch else 0
    kv_lens = prefix_lens.to(torch.int32)
    kv_indptr = _indptr(_pages(kv_lens, page_size))
    kv_indices = prefix_page_indices(req_to_token, req_pool_indices, kv_lens, kv_indptr, page_size, max_pages,
                                     out=kv_indices_out)
    tree_lens_host = torch.tensor(lengths, dtype=torch.int32)
    tree_lens_device = tree_lens_host.to(device)
    return MLATreeVerifyPlan(
        qo_indptr=_indptr(tree_lens_device),
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        kv_lens=kv_lens,
        mask_layout=tree_mask_layout(mask_mode, kv_lens, tree_lens_device),
        qo_indptr_host=_indptr(tree_lens_host),
        kv_indptr_host=_indptr(_pages(prefix_lens_host, page_size)),
        kv_lens_host=prefix_lens_host,
        tree_tokens=tree_tokens,
        page_size=page_size,
    )


def causal_tree_mask(tree_lens: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """A chain's mask in the QLEN_ONLY layout ([sum(n_b * n_b)] bool, request b's n_b x n_b block
    lower-triangular): what a verify without a tree mask (topk 1) means."""
    blocks = [torch.ones(n, n, dtype=torch.bool, device=device).tril().reshape(-1) for n in tree_lens]
    return torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool, device=device)


@dataclass(frozen=True)
class MLAShape:
    """num_heads (query heads on this rank), latent (kv_lora_rank, L), rope (qk_rope_head_dim, R), scale (the
    softmax scale), q_dtype / kv_dtype (query and cache dtypes)."""

    num_heads: int
    latent: int
    rope: int
    scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype


def plan_prefix_wrapper(flashinfer: Any, wrapper: Any, plan: MLATreeVerifyPlan, shape: MLAShape) -> None:
    """FlashInfer's plan for the prefix half: n queries a request over its paged prefix, no mask, base-2 lse.
    The host arrays carry the schedule (no device read); the page indices stay on the device."""
    metadata = flashinfer.MLAPlanMetadata.csr(plan.qo_indptr_host, plan.kv_indptr_host, plan.kv_indices,
                                              plan.kv_lens_host)
    wrapper.plan(metadata=metadata, num_heads=shape.num_heads, head_dim_ckv=shape.latent, head_dim_kpe=shape.rope,
                 page_size=plan.page_size, causal=False, sm_scale=shape.scale, q_data_type=shape.q_dtype,
                 kv_data_type=shape.kv_dtype, query_layout="split", kv_cache_layout="split", lse_mode="base2")


def paged_views(kv_buffer: torch.Tensor, latent: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's MLA layer buffer [slots, 1, L + R] as FlashInfer's split paged cache: ckv [pages, page_size, L] and
    kpe [pages, page_size, R] (views, no copy)."""
    slots, heads, width = kv_buffer.shape
    if heads != 1:
        raise ValueError(f"an MLA cache holds one latent row a slot, got {heads}")
    if slots % page_size:
        raise ValueError(f"the pool's {slots} slots are not whole pages of {page_size}")
    paged = kv_buffer.view(slots // page_size, page_size, width)
    return paged[..., :latent], paged[..., latent:]


def mla_tree_verify_attention(
    flashinfer: Any, wrapper: Any, plan: MLATreeVerifyPlan, q_latent: torch.Tensor, q_rope: torch.Tensor,
    kv_buffer: torch.Tensor, tree_slots: torch.Tensor, tree_mask: torch.Tensor, scale: float,
    out: torch.Tensor | None = None, tree_attention: Callable = mla_tree_attention,
) -> torch.Tensor:
    """One layer of tree verify: q_latent [T, H, L] (absorbed), q_rope [T, H, R]; kv_buffer: the layer's pool
    [slots, 1, L + R], the tree's rows already written at ``tree_slots`` [T]; tree_mask: SGLang's flat mask in
    ``plan.mask_layout``. ``wrapper`` was planned with ``plan_prefix_wrapper``. Returns out [T, H, L]."""
    tokens, heads, latent = q_latent.shape
    ckv, kpe = paged_views(kv_buffer, latent, plan.page_size)
    prefix_out, prefix_lse = wrapper.run(query=(q_latent, q_rope), kv_cache=(ckv, kpe), return_lse=True)
    tree_rows = kv_buffer.view(kv_buffer.shape[0], -1)[tree_slots.long()]  # [T, L + R], the tree's latent rows
    tree_out = torch.empty_like(q_latent)
    tree_lse = torch.empty((tokens, heads), dtype=torch.float32, device=q_latent.device)
    tree_attention(q_latent, q_rope, tree_rows[:, :latent].to(q_latent.dtype), tree_rows[:, latent:].to(q_rope.dtype),
                   plan.qo_indptr, tree_mask, plan.mask_layout, plan.tree_tokens, scale, tree_out, tree_lse)
    # FlashInfer's merge_state runs one block a token with every head in it, more than CUDA's 1024 threads at 128
    # heads of 512 (DeepSeek-V3 on one GPU); the merge is per (token, head), so the heads fold into the tokens
    rows = tokens * heads
    merged, _ = flashinfer.merge_state(prefix_out.reshape(rows, 1, latent), prefix_lse.reshape(rows, 1),
                                       tree_out.reshape(rows, 1, latent), tree_lse.reshape(rows, 1))
    merged = merged.view(tokens, heads, latent)
    if out is None:
        return merged
    out.copy_(merged)
    return out
