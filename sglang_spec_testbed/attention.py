"""Stand-ins for sgl-kernel's CPU decode and extend attention (``intel_amx`` backend), MHA and MLA pools.

Both read keys and values through SGLang's token tables (``req_to_token[req_pool_indices[b], :len]`` gives the
cache slots of request b), so they serve plain decoding, prefill, draft decode (where the table rows are the
per-beam tables of ``build_draft_decode_metadata_cpu``) and tree verify alike. Tree verify passes a tree mask in
the layout SGLang's workers built (``tree_mask.py``: the backend binds the mode, since sgl-kernel's op has no
argument for it): ``QLEN_ONLY``, per request an ``n x n`` block over the draft tokens with the prefix always
visible (SGLang's CPU layout, the real op's only one), or ``FULL_MASK``, per request ``n x (prefix + n)``, prefix
columns included (the GPU's layout, run here with ``SGLANG_SPEC_CPU_TREE_MASK=full``).

MLA pools (DeepSeek) hold one latent "head" whose value view is a prefix of the key row; the same code serves
them because queries arrive already absorbed (qk dim = latent + rope, value dim = latent) and attention repeats
the single KV head across the query heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_spec_testbed.tree_mask import first_use
from sglang_spec.tree.encode_sglang import TreeMaskMode, complete_tree_mask, tree_mask_cells


def _attend(queries, keys, values, scaling: float, logit_cap: float, allowed, tail=None) -> torch.Tensor:
    """queries [Q, H, D]; keys [T, Hkv, D]; values [T, Hkv, Dv]; allowed [Q, T] bool, or None when every key is
    visible; ``tail`` [Q, n] bool, with ``allowed`` None: the last n keys masked so, the others visible (a tree
    verify's prefix, without building and masking its [Q, T] block: 0.22 -> 0.19 ms a layer at 8 queries after
    1,000 tokens) -> [Q, H, Dv] float32.

    Grouped heads (query head h reads KV head h // (H / Hkv), as a repeat-interleave of the KV heads would give)
    as two batched products over the KV heads: the KV rows are read in place rather than repeated per query head.
    One layer, one request at 1,000 tokens of context on this CPU: a decode query 0.87 -> 0.13 ms, a 16-token tree
    verify 1.05 -> 0.57 ms (torch's fused attention: 0.57 / 1.50 ms, slow on a masked tree; ad-hoc timings)."""
    count, heads, dim = queries.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    # [Hkv, Q * group, D]: row (q, g) of KV head j is query head j * group + g
    grouped = queries.float().view(count, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)
    scores = torch.bmm(grouped, keys.float().permute(1, 2, 0)).mul_(scaling)  # [Hkv, Q * group, T]
    if logit_cap and logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if allowed is not None:
        scores = scores.view(kv_heads, count, group, -1).masked_fill_(~allowed[None, :, None, :], float("-inf"))
        scores = scores.view(kv_heads, count * group, -1)
    elif tail is not None:
        columns = tail.shape[1]
        scores.view(kv_heads, count, group, -1)[..., scores.shape[-1] - columns:].masked_fill_(
            ~tail[None, :, None, :], float("-inf"))
    attended = torch.bmm(torch.softmax(scores, dim=-1), values.float().transpose(0, 1))  # [Hkv, Q * group, Dv]
    return attended.view(kv_heads, count, group, -1).permute(1, 0, 2, 3).reshape(count, heads, -1)


# an extend of this many queries or more (a prefill; never a tree verify, whose budget is at most 64 nodes) runs
# torch's fused attention: one layer of SmolLM2 on one thread, 550 / 1,000 causal queries: 30 / 78 ms through
# _attend's two products, 10 / 33 ms fused with the mask, 10 / 22 ms fused and causal (ad-hoc timings)
FUSED_MIN_QUERIES = 128


def _attend_fused(queries, keys, values, scaling: float, allowed, causal: bool) -> torch.Tensor:
    """``_attend``'s result (float32 up to summation order) through torch's fused attention: queries [Q, H, D];
    keys [T, Hkv, D]; values [T, Hkv, Dv]; ``allowed`` [Q, T] bool, or None with ``causal`` (then Q == T: a
    prefill without a cached prefix) -> [Q, H, Dv] float32. No logit cap."""
    attended = F.scaled_dot_product_attention(
        queries.float().transpose(0, 1)[None], keys.float().transpose(0, 1)[None],
        values.float().transpose(0, 1)[None], attn_mask=allowed, is_causal=causal, scale=scaling, enable_gqa=True)
    return attended[0].transpose(0, 1)


def _has_window(sliding_window) -> bool:
    """Whether SGLang's ``sliding_window`` argument names a window (None or <= 0: none)."""
    return sliding_window is not None and sliding_window > 0


def _window(allowed, query_positions: torch.Tensor, total: int, sliding_window: int):
    """Restricts ``allowed`` [Q, total] (None: all visible) to keys within ``sliding_window`` of each query
    position (no window: ``allowed`` returned as given)."""
    if not _has_window(sliding_window):
        return allowed
    key_positions = torch.arange(total, device=query_positions.device)
    in_window = key_positions[None, :] > query_positions[:, None] - sliding_window
    return in_window if allowed is None else allowed & in_window


def _scaled(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Gathered cache rows times the cache's scale (rows is a fresh gather: scaled in place, not copied again)."""
    return rows if scale == 1.0 else rows.mul_(scale)


def _prefix_and_new(buffer: torch.Tensor, scale: float, prefix_slots: torch.Tensor, new_rows: torch.Tensor):
    """[prefix + new, heads, dim]: the prefix's cached rows (scaled) then ``new_rows``, written into one tensor
    (no concatenation copy: a one-token verify is every plain step under tree auto)."""
    prefix = prefix_slots.numel()
    out = torch.empty((prefix + new_rows.shape[0], *new_rows.shape[1:]), dtype=new_rows.dtype)
    if buffer.dtype == new_rows.dtype:
        torch.index_select(buffer, 0, prefix_slots, out=out[:prefix])
        _scaled(out[:prefix], scale)
    else:  # a quantized cache: dequantize on the way
        out[:prefix] = buffer[prefix_slots].to(torch.float32).mul_(scale).to(new_rows.dtype)
    out[prefix:] = new_rows
    return out


def _unsupported(is_cross: bool, sinks) -> None:
    if is_cross or sinks is not None:
        raise NotImplementedError("the CPU attention stand-in serves decoder self-attention without sinks only")


# set on a draft step's per-beam token table by the bed's ``build_draft_decode_metadata_cpu``: [bs] each request's
# prefix length, which its ``topk`` consecutive rows (its beams) hold first, before their own draft slots
BEAM_PREFIXES_ATTRIBUTE = "_sglang_spec_beam_prefixes"


def _row_groups(req_to_token, rows: list[int], windowed: bool) -> list[tuple[int, int, int]]:
    """(start, stop, shared): rows start..stop-1 attend in one pass over the ``shared`` table slots they all hold
    first, then each over its own; ``shared`` 0: one row alone. A draft step's beams (``BEAM_PREFIXES_ATTRIBUTE``)
    group by request; every other table, and any under a sliding window, goes row by row."""
    prefixes = getattr(req_to_token, BEAM_PREFIXES_ATTRIBUTE, None)
    if windowed or prefixes is None or rows != list(range(req_to_token.shape[0])):
        return [(index, index + 1, 0) for index in range(len(rows))]
    width = len(rows) // len(prefixes)
    groups = []
    for request, prefix in enumerate(prefixes):
        first = request * width
        if prefix:
            groups.append((first, first + width, prefix))
        else:
            groups += [(row, row + 1, 0) for row in range(first, first + width)]
    return groups


def decode_attention_cpu(q, k_buffer, v_buffer, k_scale, v_scale, o, k_new, v_new, cache_loc, attn_logits,
                         req_to_token, req_pool_indices, seq_lens, scaling, logit_cap, is_cross, sliding_window,
                         encoder_lens, sinks):
    """One query per row b: attends to the row's first ``seq_lens[b]`` table slots. When ``k_new`` / ``v_new`` are
    given the kernel first stores them at ``cache_loc`` (the backend leaves that write to it). A draft step's beams
    (``BEAM_PREFIXES_ATTRIBUTE``) attend together per request: the prefix gathered once, each beam's own slots after
    it behind a mask (one Python pass a request rather than a beam in each head round)."""
    _unsupported(is_cross, sinks)
    if k_new is not None and v_new is not None:
        slots = cache_loc.long()
        k_buffer[slots] = k_new.reshape(-1, *k_buffer.shape[1:]).to(k_buffer.dtype)
        if v_buffer.data_ptr() != k_buffer.data_ptr():  # MLA: the value view aliases the key row
            v_buffer[slots] = v_new.reshape(-1, *v_buffer.shape[1:]).to(v_buffer.dtype)
    rows, lengths = req_pool_indices.tolist(), seq_lens.tolist()
    windowed = _has_window(sliding_window)
    for start, stop, shared in _row_groups(req_to_token, rows, windowed):
        if not shared:
            row, length = rows[start], lengths[start]
            slots = req_to_token[row, :length].long()
            allowed = _window(None, torch.tensor([length - 1]), length, sliding_window) if windowed else None
            tail = None
        else:
            own = [req_to_token[row, shared:length] for row, length in zip(rows[start:stop], lengths[start:stop])]
            slots = torch.cat([req_to_token[rows[start], :shared], *own]).long()
            allowed = None
            tail = torch.zeros((stop - start, slots.numel() - shared), dtype=torch.bool)  # [rows, own slots]
            column = 0
            for index, slots_of_row in enumerate(own):
                tail[index, column:column + slots_of_row.numel()] = True
                column += slots_of_row.numel()
        # index_select, not k_buffer[slots]: the same rows, 0.085 -> 0.03 ms for K and V at 1,000 tokens
        keys = _scaled(torch.index_select(k_buffer, 0, slots), k_scale)
        values = _scaled(torch.index_select(v_buffer, 0, slots), v_scale)
        attended = _attend(q[start:stop], keys, values, scaling, logit_cap, allowed, tail)
        o[start:stop] = attended.to(o.dtype)


def extend_attention_cpu(q, k, v, o, k_buffer, v_buffer, k_scale, v_scale, req_to_token, req_pool_indices,
                         seq_lens, extend_seq_lens, extend_start_loc, max_extend_len, scaling, logit_cap, is_cross,
                         sliding_window, encoder_lens, sinks, tree_mask, is_causal,
                         tree_mask_mode: TreeMaskMode = TreeMaskMode.QLEN_ONLY):
    """Request b's ``extend_seq_lens[b]`` queries (rows from ``extend_start_loc[b]``) are its last tokens; keys
    are its ``seq_lens[b]`` table slots, the new ones taken from ``k`` / ``v`` when given (MLA prefill passes
    per-head keys that the latent cache does not hold). New tokens see each other causally, or through the tree
    mask in tree verify: ``tree_mask_mode`` QLEN_ONLY (``[sum n_b * n_b]``, row-major per request, the prefix
    always visible) or FULL_MASK (``[sum n_b * (prefix_b + n_b)]``, the prefix's columns read from the mask too).
    A mask may be longer than its layout needs (SGLang sizes some by an upper bound); one covering the leading
    requests only is completed for the rows DP attention padded the batch with, as SGLang's GPU backends do
    (``complete_tree_mask``); any other shorter one is refused (a mask built in another mode). Rows
    ``req_pool_indices`` holds past the planned lengths (a batch padded after it was planned) are not attended,
    their output rows zero; a request of no new tokens (a ragged verify graph's pad slot) is skipped."""
    _unsupported(is_cross, sinks)
    # host lists once, not a tensor read per request and field (a verify of one token a request is a plain step)
    rows, totals = req_pool_indices.tolist(), seq_lens.tolist()
    news, starts = extend_seq_lens.tolist(), extend_start_loc.tolist()
    if len(rows) > len(totals):
        # DP attention padded the batch after the backend planned it (a draft extend's metadata is set before its
        # forward pads): as on a GPU backend, the planned requests are attended, the padding's rows (dropped
        # after the forward) left zero
        first_use("extend over a batch DP attention padded", None, f"{len(totals)} planned requests of {len(rows)}")
        rows = rows[:len(totals)]
        o[starts[-1] + news[-1] if rows else 0:] = 0
    cells: list[int] = []
    if tree_mask is not None:
        if tree_mask_mode not in (TreeMaskMode.QLEN_ONLY, TreeMaskMode.FULL_MASK):
            raise NotImplementedError(f"the CPU extend-attention stand-in reads QLEN_ONLY or FULL_MASK tree masks, "
                                      f"not {tree_mask_mode.name}")
        prefixes = [int(total) - int(new) for total, new in zip(totals, news)]
        cells = tree_mask_cells(tree_mask_mode, prefixes, news)
        if tree_mask.numel() < sum(cells):  # the usual mask is whole: completed (or refused) only when short
            built = tree_mask.numel()
            tree_mask = complete_tree_mask(tree_mask, tree_mask_mode, prefixes, news)
            first_use("completed for DP padding rows", tree_mask_mode,
                      f"{len(rows)} requests, {built} of {sum(cells)} cells built")
    mask_offset = 0
    read = False
    for index, row in enumerate(rows):
        total, new, start = int(totals[index]), int(news[index]), int(starts[index])
        if new == 0:  # a pad slot of a ragged verify graph past the tier's tokens: no query, as on a GPU kernel
            continue
        prefix = total - new
        prefix_slots = req_to_token[row, :prefix].long()
        if k is not None and k.shape[1] != k_buffer.shape[1]:
            # MLA prefill in MHA form: per-head keys that the latent cache cannot supply for a prefix
            if prefix:
                raise NotImplementedError("the CPU attention stand-in runs MLA's MHA-form prefill without a cached "
                                          "prefix only (SGLang takes the absorbed path below its chunking threshold)")
            keys, values = k[start:start + new], v[start:start + new]
        elif k is not None and v is not None:
            keys = _prefix_and_new(k_buffer, k_scale, prefix_slots, k[start:start + new].reshape(new, *k.shape[1:]))
            values = _prefix_and_new(v_buffer, v_scale, prefix_slots, v[start:start + new].reshape(new, *v.shape[1:]))
        else:
            slots = req_to_token[row, :total].long()
            keys, values = _scaled(k_buffer[slots], k_scale), _scaled(v_buffer[slots], v_scale)
        allowed = None  # a lone token sees its prefix and itself whatever the mask (a tree's root, a plain step)
        tail = None  # [new, new]: the mask of the new tokens' own columns, the prefix all visible
        if new > 1 and tree_mask is not None:
            block = tree_mask[mask_offset:mask_offset + cells[index]].view(new, -1).bool()
            if tree_mask_mode == TreeMaskMode.FULL_MASK:
                allowed = block  # [new, prefix + new]
            else:
                tail = block
            read = True
        elif new > 1 and is_causal:
            tail = torch.ones((new, new), dtype=torch.bool).tril()
        if tree_mask is not None:
            mask_offset += cells[index]
        windowed = allowed
        if tail is not None and (new >= FUSED_MIN_QUERIES or _has_window(sliding_window)):
            windowed = torch.ones((new, total), dtype=torch.bool)  # the dense mask these paths read
            windowed[:, prefix:] = tail
            tail = None
        windowed = _window(windowed, prefix + torch.arange(new), total, sliding_window)
        if new >= FUSED_MIN_QUERIES and tree_mask is None and not (logit_cap and logit_cap > 0):
            causal = is_causal and prefix == 0 and not _has_window(sliding_window)
            attended = _attend_fused(q[start:start + new], keys, values, scaling, None if causal else windowed, causal)
        else:
            attended = _attend(q[start:start + new], keys, values, scaling, logit_cap, windowed, tail)
        o[start:start + new] = attended.to(o.dtype)
    if read:
        first_use("read", tree_mask_mode, f"extend attention: {len(rows)} requests x {max(news)} tokens, "
                                          f"{sum(cells)} cells")


STAND_INS = {function.__name__: function for function in (decode_attention_cpu, extend_attention_cpu)}
