"""Stand-ins for sgl-kernel's CPU decode and extend attention (``intel_amx`` backend), MHA and MLA pools.

Both read keys and values through SGLang's token tables (``req_to_token[req_pool_indices[b], :len]`` gives the
cache slots of request b), so they serve plain decoding, prefill, draft decode (where the table rows are the
per-beam tables of ``build_draft_decode_metadata_cpu``) and tree verify alike. Tree verify passes the
``QLEN_ONLY`` tree mask: per request an ``n x n`` block over the draft tokens, the prefix always visible.

MLA pools (DeepSeek) hold one latent "head" whose value view is a prefix of the key row; the same code serves
them because queries arrive already absorbed (qk dim = latent + rope, value dim = latent) and attention repeats
the single KV head across the query heads.
"""

from __future__ import annotations

import torch


def _attend(queries, keys, values, scaling: float, logit_cap: float, allowed) -> torch.Tensor:
    """queries [B, Q, H, D]; keys [B, T, Hkv, D]; values [B, T, Hkv, Dv]; allowed [B, Q, T] bool -> [B, Q, H, Dv]
    float32. Query head h reads KV head h // (H / Hkv), as SGLang's grouped-query layout does."""
    batch, num_queries, heads, dim = queries.shape
    kv_heads = keys.shape[2]
    grouped = queries.float().reshape(batch, num_queries, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("bqkgd,btkd->bkgqt", grouped, keys.float()) * scaling
    if logit_cap and logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    attended = torch.einsum("bkgqt,btkv->bqkgv", torch.softmax(scores, dim=-1), values.float())
    return attended.reshape(batch, num_queries, heads, -1)


def _window(allowed: torch.Tensor, query_positions: torch.Tensor, sliding_window: int) -> torch.Tensor:
    """Restricts ``allowed`` [B, Q, T] to keys within ``sliding_window`` of each query position [B, Q] (<= 0: no
    window)."""
    if sliding_window is None or sliding_window <= 0:
        return allowed
    key_positions = torch.arange(allowed.shape[2], device=allowed.device)
    return allowed & (key_positions > query_positions[..., None] - sliding_window)


def _unsupported(is_cross: bool, sinks) -> None:
    if is_cross or sinks is not None:
        raise NotImplementedError("the CPU attention stand-in serves decoder self-attention without sinks only")


def _token_slots(req_to_token, req_pool_indices, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's first ``lengths[b]`` table slots, padded to the longest: slots [B, T] int64 (0 past the
    end, so the gather stays in bounds) and valid [B, T] bool."""
    longest = int(lengths.max()) if lengths.numel() else 0
    valid = torch.arange(longest, device=lengths.device) < lengths[:, None]
    slots = req_to_token[req_pool_indices.long(), :longest].long()
    return torch.where(valid, slots, 0), valid


def decode_attention_cpu(q, k_buffer, v_buffer, k_scale, v_scale, o, k_new, v_new, cache_loc, attn_logits,
                         req_to_token, req_pool_indices, seq_lens, scaling, logit_cap, is_cross, sliding_window,
                         encoder_lens, sinks):
    """One query per row b: attends to the row's first ``seq_lens[b]`` table slots, all rows at once (padded to the
    longest). When ``k_new`` / ``v_new`` are given the kernel first stores them at ``cache_loc`` (the backend leaves
    that write to it)."""
    _unsupported(is_cross, sinks)
    if k_new is not None and v_new is not None:
        slots = cache_loc.long()
        k_buffer[slots] = k_new.reshape(-1, *k_buffer.shape[1:]).to(k_buffer.dtype)
        if v_buffer.data_ptr() != k_buffer.data_ptr():  # MLA: the value view aliases the key row
            v_buffer[slots] = v_new.reshape(-1, *v_buffer.shape[1:]).to(v_buffer.dtype)
    if q.shape[0] == 0:
        return
    lengths = seq_lens.long()
    slots, valid = _token_slots(req_to_token, req_pool_indices, lengths)
    allowed = _window(valid[:, None], (lengths - 1)[:, None], sliding_window)
    attended = _attend(q.reshape(q.shape[0], 1, *q.shape[1:]), k_buffer[slots] * k_scale, v_buffer[slots] * v_scale,
                       scaling, logit_cap, allowed)
    o.copy_(attended.reshape(o.shape).to(o.dtype))


def extend_attention_cpu(q, k, v, o, k_buffer, v_buffer, k_scale, v_scale, req_to_token, req_pool_indices,
                         seq_lens, extend_seq_lens, extend_start_loc, max_extend_len, scaling, logit_cap, is_cross,
                         sliding_window, encoder_lens, sinks, tree_mask, is_causal):
    """Request b's ``extend_seq_lens[b]`` queries (rows from ``extend_start_loc[b]``) are its last tokens; keys
    are its ``seq_lens[b]`` table slots, the new ones taken from ``k`` / ``v`` when given (MLA prefill passes
    per-head keys that the latent cache does not hold). New tokens see each other causally, or through the
    ``QLEN_ONLY`` tree mask (``[sum n_b * n_b]``, row-major per request) in tree verify. All requests at once,
    padded to the most queries (Q) and keys (T)."""
    _unsupported(is_cross, sinks)
    if q.shape[0] == 0 or seq_lens.numel() == 0:
        return
    totals, new = seq_lens.long(), extend_seq_lens.long()
    prefix, starts = totals - new, extend_start_loc.long()
    query_index = torch.arange(int(new.max()), device=q.device)
    query_valid = query_index < new[:, None]  # [B, Q]
    query_rows = torch.where(query_valid, starts[:, None] + query_index, 0)
    slots, key_valid = _token_slots(req_to_token, req_pool_indices, totals)  # [B, T]
    new_key = torch.arange(slots.shape[1], device=q.device) - prefix[:, None]  # [B, T]: index among the new tokens
    is_new = key_valid & (new_key >= 0)
    new_rows = torch.where(is_new, starts[:, None] + new_key, 0)
    if k is not None and k.shape[1] != k_buffer.shape[1]:
        # MLA prefill in MHA form: per-head keys that the latent cache cannot supply for a prefix
        if bool((prefix > 0).any()):
            raise NotImplementedError("the CPU attention stand-in runs MLA's MHA-form prefill without a cached "
                                      "prefix only (SGLang takes the absorbed path below its chunking threshold)")
        keys, values = k[new_rows], v[new_rows]
    elif k is not None and v is not None:
        keys = torch.where(is_new[..., None, None], k[new_rows], (k_buffer[slots] * k_scale).to(k.dtype))
        values = torch.where(is_new[..., None, None], v[new_rows], (v_buffer[slots] * v_scale).to(v.dtype))
    else:
        keys, values = k_buffer[slots] * k_scale, v_buffer[slots] * v_scale
    # [B, Q, T]: the prefix always, the new tokens causally or through the tree mask
    among_new = new_key[:, None, :]
    if tree_mask is not None:
        offsets = torch.cumsum(new * new, 0) - new * new
        cell = offsets[:, None, None] + query_index[None, :, None] * new[:, None, None] + among_new
        sees_new = tree_mask.reshape(-1)[torch.where(is_new[:, None, :] & query_valid[..., None], cell, 0)].bool()
    elif is_causal:
        sees_new = among_new <= query_index[None, :, None]
    else:
        sees_new = torch.ones_like(is_new)[:, None, :]
    allowed = key_valid[:, None, :] & torch.where(among_new >= 0, sees_new, True)
    allowed = _window(allowed, prefix[:, None] + query_index, sliding_window)
    attended = _attend(q[query_rows], keys, values, scaling, logit_cap, allowed)
    o[query_rows[query_valid]] = attended[query_valid].to(o.dtype)


STAND_INS = {function.__name__: function for function in (decode_attention_cpu, extend_attention_cpu)}
