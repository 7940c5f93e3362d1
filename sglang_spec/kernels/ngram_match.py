"""Context lookup on the device: for each query (a request's token history plus the draft tokens of a tree node
below its root) the continuations ``tree/ngram.NgramIndex.continuations`` gives, computed from a token history
held on the device, so a server can look a context up without reading it on the host.

The answer, per query (``NgramIndex``'s, exactly): the longest n-gram (n <= ``max_ngram``) ending the query's
sequence (history + tail) that also ends earlier in the history with a following token there; among its latest
``MAX_OCCURRENCES`` such occurrences, the distinct following tokens, most frequent first, then most recent; the
first ``width`` of them.

How, without an index: the match length of history position e is m(e) = the number of tokens, going back from e,
that equal the query's sequence going back from its end (at most ``max_ngram``). The longest n-gram is
n* = max m(e) over e <= length - 2 (a following token in the history), and its occurrences are the e with
m(e) = n*. One program per query reads the history twice: once for n*, once backwards to take the latest
occurrences. Neither the kernel nor its launcher reads a tensor on the host; the reference (the CPU back-end,
vectorised over queries) neither.

Layouts: ``history`` [R, L] int64, row r valid for its first ``lengths[r]`` tokens (the request's prompt and
committed output, the root last); a query names its row (``query_rows``) and its tail (``tails`` [Q, T], the
first ``tail_lengths[q]`` valid: the node's path below the root, empty for the root).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_spec.tree.ngram import MAX_OCCURRENCES

BLOCK_POSITIONS = 64  # history positions a program compares at once


@dataclass(frozen=True)
class NgramMatches:
    """Each query's continuations, best first (column = rank), as ``NgramIndex.continuations`` ranks them.

    tokens:        [Q, W] int64, the following token; -1 past the query's candidates.
    counts:        [Q, W] int64, how often it followed among the occurrences read; 0 past the candidates.
    positions:     [Q, W] int64, history index of its most recent occurrence (the copied token); -1 past them.
    match_lengths: [Q] int64, n* (1..max_ngram), the same for every candidate of the query; 0 when none matched.
    """

    tokens: torch.Tensor
    counts: torch.Tensor
    positions: torch.Tensor
    match_lengths: torch.Tensor

    @classmethod
    def empty(cls, queries: int, width: int, device: torch.device | str) -> NgramMatches:
        """Output buffers for ``queries`` queries of ``width`` candidates."""
        def full(shape: tuple[int, ...], value: int) -> torch.Tensor:
            return torch.full(shape, value, dtype=torch.int64, device=device)
        return cls(full((queries, width), -1), full((queries, width), 0), full((queries, width), -1),
                   full((queries,), 0))


def _check(history: torch.Tensor, lengths: torch.Tensor, query_rows: torch.Tensor, tails: torch.Tensor,
           tail_lengths: torch.Tensor, max_ngram: int, width: int) -> None:
    if history.dim() != 2 or tails.dim() != 2:
        raise ValueError(f"history [R, L] and tails [Q, T] must be 2-D, got {tuple(history.shape)} and "
                         f"{tuple(tails.shape)}")
    if lengths.shape != (history.shape[0],):
        raise ValueError(f"lengths must be [R] = [{history.shape[0]}], got {tuple(lengths.shape)}")
    if query_rows.shape != (tails.shape[0],) or tail_lengths.shape != (tails.shape[0],):
        raise ValueError(f"query_rows and tail_lengths must be [Q] = [{tails.shape[0]}]")
    if max_ngram < 1 or not 1 <= width <= MAX_OCCURRENCES:
        raise ValueError(f"max_ngram must be >= 1 and width in 1..{MAX_OCCURRENCES}, got {max_ngram} and {width}")


@triton.jit
def _match_lengths(history, position, running, back, back_index, longest, N: tl.constexpr, BLOCK: tl.constexpr):
    """m(e) for the history positions ``position`` [BLOCK] where ``running``: how many tokens going back from e
    equal ``back`` (the query's sequence backwards), at most ``longest``."""
    match = tl.zeros((BLOCK,), dtype=tl.int64)
    for j in tl.static_range(N):
        query_token = tl.sum(tl.where(back_index == j, back, 0))
        earlier = position - j
        token = tl.load(history + earlier, mask=running & (earlier >= 0), other=-1)
        running = running & (earlier >= 0) & (token == query_token) & (j < longest)
        match += running.to(tl.int64)
    return match


@triton.jit
def _ngram_match_kernel(
    history_ptr,  # [R, L] int64 token ids (row stride ROW_STRIDE)
    lengths_ptr,  # [R] int64 valid tokens per row
    query_rows_ptr,  # [Q] int64 history row of each query
    tails_ptr,  # [Q, T] int64 tail tokens (row stride T)
    tail_lengths_ptr,  # [Q] int64
    tokens_ptr,  # out [Q, W] int64
    counts_ptr,  # out [Q, W] int64
    positions_ptr,  # out [Q, W] int64
    match_lengths_ptr,  # out [Q] int64
    ROW_STRIDE,
    T,
    N: tl.constexpr,  # max_ngram
    N_PAD: tl.constexpr,
    W: tl.constexpr,
    W_PAD: tl.constexpr,
    OCCURRENCES: tl.constexpr,  # MAX_OCCURRENCES, a power of two
    BLOCK: tl.constexpr,
):
    # program q answers query q
    q = tl.program_id(0)
    row = tl.load(query_rows_ptr + q)
    length = tl.load(lengths_ptr + row)
    tail_length = tl.load(tail_lengths_ptr + q)
    total = length + tail_length
    longest = tl.minimum(total, N)
    history = history_ptr + row * ROW_STRIDE
    # the query's sequence backwards from its end: back[j] = sequence[total - 1 - j], j < longest
    back_index = tl.arange(0, N_PAD)
    index = total - 1 - back_index
    in_tail = index >= length
    from_tail = tl.load(tails_ptr + q * T + (index - length), mask=in_tail & (back_index < longest), other=-1)
    from_history = tl.load(history + index, mask=(~in_tail) & (back_index < longest) & (index >= 0), other=-1)
    back = tl.where(in_tail, from_tail, from_history)

    # pass 1: n* = the longest match over positions with a following token (e <= length - 2)
    last = length - 2
    offsets = tl.arange(0, BLOCK)
    best = tl.zeros((), dtype=tl.int64)
    for start in range(0, last + 1, BLOCK):
        position = start + offsets
        match = _match_lengths(history, position, position <= last, back, back_index, longest, N, BLOCK)
        best = tl.maximum(best, tl.max(match))
    tl.store(match_lengths_ptr + q, best)

    # pass 2: the latest OCCURRENCES positions e with m(e) = n*, newest first, into registers (slot = recency)
    slots = tl.arange(0, OCCURRENCES)
    slot_tokens = tl.full((OCCURRENCES,), -1, dtype=tl.int64)
    slot_positions = tl.full((OCCURRENCES,), -1, dtype=tl.int64)
    taken = tl.zeros((), dtype=tl.int64)
    blocks = tl.cdiv(last + 1, BLOCK)
    for step in range(0, blocks):
        start = (blocks - 1 - step) * BLOCK
        position = start + offsets
        match = _match_lengths(history, position, (position <= last) & (best > 0), back, back_index, longest, N,
                               BLOCK)
        hit = (match == best) & (best > 0)
        hits = hit.to(tl.int64)
        # recency of a hit: hits in earlier-read blocks, plus the hits after it in this block
        recency = taken + tl.sum(hits) - tl.cumsum(hits, 0)
        following = tl.load(history + position + 1, mask=hit, other=-1)
        chosen = (recency[None, :] == slots[:, None]) & hit[None, :]  # [OCCURRENCES, BLOCK]
        slot_tokens = tl.where(tl.sum(chosen.to(tl.int64), 1) > 0,
                               tl.sum(tl.where(chosen, following[None, :], 0), 1), slot_tokens)
        slot_positions = tl.where(tl.sum(chosen.to(tl.int64), 1) > 0,
                                  tl.sum(tl.where(chosen, position[None, :] + 1, 0), 1), slot_positions)
        taken += tl.sum(hits)

    # distinct following tokens: count each, keep its newest slot; rank by (count desc, recency)
    valid = slot_tokens >= 0
    same = (slot_tokens[:, None] == slot_tokens[None, :]) & valid[:, None] & valid[None, :]  # [O, O]
    counts = tl.sum(same.to(tl.int64), 1)
    newer_same = same & (slots[None, :] < slots[:, None])
    first = valid & (tl.sum(newer_same.to(tl.int64), 1) == 0)
    score = tl.where(first, counts * (2 * OCCURRENCES) + (OCCURRENCES - 1 - slots), -1)
    ranks = tl.arange(0, W_PAD)
    out_tokens = tl.full((W_PAD,), -1, dtype=tl.int64)
    out_counts = tl.zeros((W_PAD,), dtype=tl.int64)
    out_positions = tl.full((W_PAD,), -1, dtype=tl.int64)
    for rank in tl.static_range(W):
        top = tl.max(score)
        pick = (score == top) & (top >= 0)
        out_tokens = tl.where(ranks == rank, tl.sum(tl.where(pick, slot_tokens, 0)) + (top < 0).to(tl.int64) * -1,
                              out_tokens)
        out_counts = tl.where(ranks == rank, tl.sum(tl.where(pick, counts, 0)), out_counts)
        out_positions = tl.where(ranks == rank, tl.sum(tl.where(pick, slot_positions, 0)) + (top < 0).to(tl.int64) * -1,
                                 out_positions)
        score = tl.where(pick, -1, score)
    tl.store(tokens_ptr + q * W + ranks, out_tokens, mask=ranks < W)
    tl.store(counts_ptr + q * W + ranks, out_counts, mask=ranks < W)
    tl.store(positions_ptr + q * W + ranks, out_positions, mask=ranks < W)


def ngram_match(history: torch.Tensor, lengths: torch.Tensor, query_rows: torch.Tensor, tails: torch.Tensor,
                tail_lengths: torch.Tensor, max_ngram: int, width: int,
                out: NgramMatches | None = None) -> NgramMatches:
    """Launcher: one program per query (module doc for the layouts; every tensor int64 on one device). Writes
    ``out`` (made when None) and returns it. The history's rows may be strided (a view of a wider buffer); the
    per-query inputs are made contiguous, because the kernel indexes them densely: a batch of one request builds
    its query rows by ``expand``, a stride-0 view whose element q the kernel would otherwise read past the end."""
    _check(history, lengths, query_rows, tails, tail_lengths, max_ngram, width)
    if history.shape[1] and history.stride(1) != 1:
        raise ValueError("history's rows must be contiguous (stride 1 along a row)")
    queries = tails.shape[0]
    out = NgramMatches.empty(queries, width, history.device) if out is None else out
    if not all(buffer.is_contiguous() for buffer in (out.tokens, out.counts, out.positions, out.match_lengths)):
        raise ValueError("out's buffers must be contiguous")
    if queries == 0:
        return out
    _ngram_match_kernel[(queries,)](
        history, lengths.contiguous(), query_rows.contiguous(), tails.contiguous(), tail_lengths.contiguous(),
        out.tokens, out.counts, out.positions, out.match_lengths,
        history.stride(0), max(tails.shape[1], 1),
        N=max_ngram, N_PAD=triton.next_power_of_2(max_ngram), W=width, W_PAD=triton.next_power_of_2(width),
        OCCURRENCES=MAX_OCCURRENCES, BLOCK=BLOCK_POSITIONS,
    )
    return out


def ngram_match_reference(history: torch.Tensor, lengths: torch.Tensor, query_rows: torch.Tensor,
                          tails: torch.Tensor, tail_lengths: torch.Tensor, max_ngram: int, width: int,
                          out: NgramMatches | None = None) -> NgramMatches:
    """The kernel's answer in torch, vectorised over queries ([Q, L] and [Q, O, O] intermediates)."""
    _check(history, lengths, query_rows, tails, tail_lengths, max_ngram, width)
    device = history.device
    queries, span = tails.shape[0], history.shape[1]
    rows = history[query_rows]  # [Q, L]
    length = lengths[query_rows]  # [Q]
    total = length + tail_lengths
    longest = torch.clamp(total, max=max_ngram)
    # back[q, j] = sequence[total - 1 - j] for j < longest, else -1
    back_index = torch.arange(max_ngram, device=device)
    index = total[:, None] - 1 - back_index[None, :]  # [Q, N]
    in_tail = index >= length[:, None]
    tail_token = torch.gather(tails, 1, (index - length[:, None]).clamp(0, max(tails.shape[1] - 1, 0))) \
        if tails.shape[1] else torch.full_like(index, -1)
    history_token = torch.gather(rows, 1, index.clamp(0, span - 1))
    back = torch.where(in_tail, tail_token, history_token)
    back = torch.where((back_index[None, :] < longest[:, None]) & (index >= 0), back, torch.full_like(back, -1))

    position = torch.arange(span, device=device)
    last = length - 2
    running = position[None, :] <= last[:, None]  # [Q, L]
    match = torch.zeros(queries, span, dtype=torch.int64, device=device)
    for j in range(max_ngram):
        earlier = position - j
        token = torch.gather(rows, 1, earlier.clamp(min=0)[None, :].expand(queries, span))
        running = running & (earlier >= 0)[None, :] & (token == back[:, j:j + 1]) & (j < longest)[:, None]
        match += running.long()
    best = match.max(dim=1).values if span else torch.zeros(queries, dtype=torch.int64, device=device)
    hit = (match == best[:, None]) & (best[:, None] > 0)
    # recency of a hit: the hits after it; the latest OCCURRENCES kept
    recency = hit.long().flip(1).cumsum(1).flip(1) - hit.long()
    kept = hit & (recency < MAX_OCCURRENCES)
    following = torch.gather(rows, 1, (position + 1).clamp(max=span - 1)[None, :].expand(queries, span))
    slot_tokens = torch.full((queries, MAX_OCCURRENCES + 1), -1, dtype=torch.int64, device=device)
    slot_positions = torch.full((queries, MAX_OCCURRENCES + 1), -1, dtype=torch.int64, device=device)
    target = torch.where(kept, recency, torch.full_like(recency, MAX_OCCURRENCES))  # unkept -> a spare column
    slot_tokens.scatter_(1, target, torch.where(kept, following, torch.full_like(following, -1)))
    slot_positions.scatter_(1, target, torch.where(kept, (position + 1)[None, :].expand(queries, span),
                                                   torch.full_like(following, -1)))
    slot_tokens, slot_positions = slot_tokens[:, :MAX_OCCURRENCES], slot_positions[:, :MAX_OCCURRENCES]

    slots = torch.arange(MAX_OCCURRENCES, device=device)
    valid = slot_tokens >= 0
    same = (slot_tokens[:, :, None] == slot_tokens[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    counts = same.long().sum(2)
    first = valid & ~(same & (slots[None, None, :] < slots[None, :, None])).any(2)
    score = torch.where(first, counts * (2 * MAX_OCCURRENCES) + (MAX_OCCURRENCES - 1 - slots)[None, :],
                        torch.full_like(counts, -1))
    top, order = score.topk(width, dim=1)
    found = top >= 0
    result = NgramMatches(
        tokens=torch.where(found, torch.gather(slot_tokens, 1, order), torch.full_like(order, -1)),
        counts=torch.where(found, torch.gather(counts, 1, order), torch.zeros_like(order)),
        positions=torch.where(found, torch.gather(slot_positions, 1, order), torch.full_like(order, -1)),
        match_lengths=best,
    )
    if out is None:
        return result
    for name in ("tokens", "counts", "positions", "match_lengths"):
        getattr(out, name).copy_(getattr(result, name))
    return out
