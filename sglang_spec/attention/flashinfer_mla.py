"""The CPU twin of the FlashInfer calls MLA tree verify makes (``sglang_plugin/mla_cascade.py``): pure-torch
stand-ins with FlashInfer 0.7's signatures and layouts, so the back-end's planning, indexing, paging and merge run
on this CPU, as ``kernels.py`` stands in sgl-kernel's ops.

* ``BatchMLAPagedAttentionWrapper``: ``__init__(float_workspace_buffer, use_cuda_graph, qo_indptr, kv_indptr,
  kv_indices, kv_len_arr, backend)``; ``plan(metadata=MLAPlanMetadata.csr(...), num_heads, head_dim_ckv,
  head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type, query_layout, kv_cache_layout, lse_mode)``;
  ``run(query=(q_nope, q_pe), kv_cache=(ckv [pages, page_size, L], kpe [pages, page_size, R]), out, lse,
  return_lse)``. The plan is checked as FlashInfer checks it (each kv_len within its pages, indptrs monotone,
  the run's query rows equal to qo_indptr's total, the cache's page size the planned one), so a paging mistake
  fails here as it would on a GPU rather than reading a wrong row quietly. With ``use_cuda_graph`` the plan is
  copied into the caller's buffers, as FlashInfer does for a captured graph.
* ``merge_state(v_a, s_a, v_b, s_b)``: FlashInfer's merge, lse in base 2, through ``cascade.merge_states``; it
  refuses the shapes FlashInfer's launch refuses (more than 1024 threads a block).
* ``MLAPlanMetadata.csr``: the canonical metadata object.

Lse is base 2 (``lse_mode="base2"``) or natural (``"basee"``), as planned. Numerics: float32 accumulation over the
rows the plan names, ``cascade.mla_attention`` per request (causal plans align the queries with the last kv rows,
FlashInfer's bottom-right convention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from sglang_spec.attention.cascade import AttentionState, merge_states, mla_attention

LN_2 = math.log(2.0)


@dataclass(frozen=True, eq=False)
class MLAPlanMetadata:
    """FlashInfer's canonical CSR metadata: qo_indptr [B + 1], kv_indptr [B + 1] (pages), kv_indices (page ids),
    kv_len_arr [B] (tokens)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len_arr: torch.Tensor

    @classmethod
    def csr(cls, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
            kv_len_arr: torch.Tensor) -> MLAPlanMetadata:
        return cls(qo_indptr, kv_indptr, kv_indices, kv_len_arr)


MAX_BLOCK_THREADS = 1024  # CUDA's limit on the threads of one block


def merge_state_threads(heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Threads of one block of FlashInfer 0.7's ``MergeState`` launch (cascade.cuh): ``head_dim / vec`` lanes for
    each of the ``heads``, vec = max(16 bytes / element size, head_dim / 32)."""
    vec = max(16 // dtype.itemsize, head_dim // 32)
    return head_dim // vec * heads


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v [S, H, D], s [S, H] float32 base-2 lse -> (merged v [S, H, D] in v_a's dtype, merged s [S, H] base 2).
    Fails where FlashInfer's launch fails: one block a row with every head in it, so more than 1024 threads
    (128 heads of 512 at DeepSeek-V3's widths, 32 lanes a head) is CUDA's invalid argument, as on a GPU."""
    threads = merge_state_threads(v_a.shape[1], v_a.shape[2], v_a.dtype)
    if threads > MAX_BLOCK_THREADS:
        raise RuntimeError(f"MergeState kernel launch failed: invalid argument ({v_a.shape[1]} heads of "
                           f"{v_a.shape[2]} need {threads} threads a block, CUDA allows {MAX_BLOCK_THREADS})")
    first = AttentionState(v_a.float(), s_a.float() * LN_2)
    merged = merge_states(first, AttentionState(v_b.float(), s_b.float() * LN_2))
    return merged.out.to(v_a.dtype), merged.lse / LN_2


class BatchMLAPagedAttentionWrapper:
    """See the module docstring; the subset of FlashInfer's wrapper that MLA tree verify uses."""

    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False,
                 qo_indptr: torch.Tensor | None = None, kv_indptr: torch.Tensor | None = None,
                 kv_indices: torch.Tensor | None = None, kv_len_arr: torch.Tensor | None = None,
                 backend: str = "auto") -> None:
        self._use_cuda_graph = use_cuda_graph
        self._buffers = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        if use_cuda_graph and any(buffer is None for buffer in self._buffers):
            raise ValueError("a CUDA-graph wrapper needs its qo_indptr, kv_indptr, kv_indices and kv_len_arr buffers")
        self._plan: dict | None = None
        self.plans = 0  # how many times plan() ran (the tests count them)

    def plan(self, *, metadata: MLAPlanMetadata, num_heads: int, head_dim_ckv: int, head_dim_kpe: int,
             page_size: int, causal: bool, sm_scale: float, q_data_type: torch.dtype, kv_data_type: torch.dtype,
             query_layout: str = "packed", kv_cache_layout: str = "packed", lse_mode: str = "none") -> None:
        qo_indptr = metadata.qo_indptr.to("cpu", torch.int64)
        kv_indptr = metadata.kv_indptr.to("cpu", torch.int64)
        kv_lens = metadata.kv_len_arr.to("cpu", torch.int64)
        batch = kv_lens.shape[0]
        if qo_indptr.shape != (batch + 1,) or kv_indptr.shape != (batch + 1,):
            raise ValueError(f"qo_indptr and kv_indptr must be [B + 1] = [{batch + 1}]")
        if (qo_indptr.diff() < 0).any() or (kv_indptr.diff() < 0).any() or qo_indptr[0] != 0 or kv_indptr[0] != 0:
            raise ValueError("qo_indptr and kv_indptr must start at 0 and never decrease")
        pages = kv_indptr.diff()
        if ((kv_lens + page_size - 1) // page_size != pages).any():
            raise ValueError(f"kv_len_arr {kv_lens.tolist()} disagrees with kv_indptr's pages {pages.tolist()} at "
                             f"page size {page_size}")
        if metadata.kv_indices.shape[0] < int(kv_indptr[-1]):
            raise ValueError(f"kv_indices holds {metadata.kv_indices.shape[0]} pages, kv_indptr names "
                             f"{int(kv_indptr[-1])}")
        if lse_mode not in ("none", "base2", "basee"):
            raise ValueError(f"lse_mode must be none, base2 or basee, got {lse_mode!r}")
        kv_indices = metadata.kv_indices
        if self._use_cuda_graph:  # a captured graph reads the caller's buffers: the plan is copied into them
            qo_buffer, kv_indptr_buffer, kv_indices_buffer, kv_len_buffer = self._buffers
            assert qo_buffer is not None and kv_indptr_buffer is not None and kv_indices_buffer is not None \
                and kv_len_buffer is not None  # checked at construction
            qo_buffer[: batch + 1].copy_(metadata.qo_indptr)
            kv_indptr_buffer[: batch + 1].copy_(metadata.kv_indptr)
            kv_len_buffer[:batch].copy_(metadata.kv_len_arr)
            if kv_indices_buffer.data_ptr() != kv_indices.data_ptr():
                kv_indices_buffer[: kv_indices.shape[0]].copy_(kv_indices)
            kv_indices = kv_indices_buffer
        self._plan = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_lens=kv_lens, kv_indices=kv_indices,
                          num_heads=num_heads, head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe,
                          page_size=page_size, causal=causal, sm_scale=sm_scale, lse_mode=lse_mode)
        self.plans += 1

    def run(self, *, query: tuple[torch.Tensor, torch.Tensor], kv_cache: tuple[torch.Tensor, torch.Tensor],
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self._plan is None:
            raise RuntimeError("run() before plan()")
        plan = self._plan
        q_nope, q_pe = query
        ckv, kpe = kv_cache
        total = int(plan["qo_indptr"][-1])
        if q_nope.shape != (total, plan["num_heads"], plan["head_dim_ckv"]) or q_pe.shape[-1] != plan["head_dim_kpe"]:
            raise ValueError(f"the query must be [{total}, {plan['num_heads']}, {plan['head_dim_ckv']}] as planned, "
                             f"got {tuple(q_nope.shape)}")
        if ckv.shape[1:] != (plan["page_size"], plan["head_dim_ckv"]) or kpe.shape[1:] != (plan["page_size"],
                                                                                          plan["head_dim_kpe"]):
            raise ValueError(f"the cache must be [pages, {plan['page_size']}, L / R] as planned, got "
                             f"{tuple(ckv.shape)} and {tuple(kpe.shape)}")
        if return_lse and plan["lse_mode"] == "none":
            raise ValueError("return_lse needs a plan with lse_mode base2 or basee")
        out = torch.empty_like(q_nope) if out is None else out
        lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device=q_nope.device) if lse is None else lse
        indices = plan["kv_indices"].long()
        for b in range(plan["kv_lens"].shape[0]):
            first, last = int(plan["qo_indptr"][b]), int(plan["qo_indptr"][b + 1])
            length = int(plan["kv_lens"][b])
            pages = indices[int(plan["kv_indptr"][b]):int(plan["kv_indptr"][b + 1])]
            keys = ckv[pages].reshape(-1, ckv.shape[-1])[:length].float()
            rope_keys = kpe[pages].reshape(-1, kpe.shape[-1])[:length].float()
            mask = None
            if plan["causal"]:  # bottom-right aligned: query i of n sees the kv rows up to length - n + i
                rows = torch.arange(last - first)[:, None] + length - (last - first)
                mask = torch.arange(length)[None, :] <= rows
            state = mla_attention(q_nope[first:last].float(), q_pe[first:last].float(), keys, rope_keys,
                                  plan["sm_scale"], mask=mask)
            out[first:last] = state.out.to(out.dtype)
            lse[first:last] = state.lse / LN_2 if plan["lse_mode"] != "basee" else state.lse
        return (out, lse) if return_lse else out


def namespace() -> SimpleNamespace:
    """The twin as the namespace ``sglang_plugin/mla_cascade.py`` takes (the real one: FlashInfer's)."""
    return SimpleNamespace(BatchMLAPagedAttentionWrapper=BatchMLAPagedAttentionWrapper,
                           MLAPlanMetadata=MLAPlanMetadata, merge_state=merge_state)
