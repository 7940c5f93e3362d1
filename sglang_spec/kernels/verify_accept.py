"""Fused verify + accept: target logits at every tree node -> accepted path, accept length, bonus token, and the
emitted tokens appended to each request's output buffer.

Two launches, each a Triton kernel beside its launcher and its pure-torch reference:

1. per node (one program per tree node, a loop over the vocabulary):
   * ``target_tokens``: the target's token at the node. Greedy: argmax (first index on ties). Sampling (per-request
     temperature >= ``TEMPERATURE_FLOOR``, 1e-5; lower ones are greedy, as everywhere): an inverse-CDF draw with
     the node's coin from the tempered distribution after top-k and top-p, whose thresholds are found by a
     16-way search over float32 bit patterns (8 passes over the vocabulary each, no sort); the
     definitions are those of ``sglang_spec.sampling.target_probs_from_logits``.
   * ``top_n_probs`` (relaxed mode): the N most likely tokens and their plain-softmax probabilities.
2. per request: ``accept_walk`` follows the tree from the root, in the ``AcceptMode`` it is given.
   ``MatchMode`` (greedy and lossless sampling, SpecExec's sample-and-match): move to the lowest-index child whose
   token equals the node's target token. ``CandidateSampleMode`` (lossless sampling the way SGLang's
   ``tree_speculative_sampling_target_only`` draws it, ``verify/target_only.py``): accept the first child whose
   bucket in the running sum of the children's target probabilities holds the node's coin; the bonus is drawn from
   the target without the last node's children by the final coin (``node_normalizers`` gives each node's softmax
   maximum and sum first). ``RelaxedMode`` (LOSSY, opt-in, TensorRT-LLM's thinking-phase rule): move
   to the most probable child that is in the node's top-N and within ``delta`` of the top probability while inside
   a thinking span (strict outside). The bonus is the target token (relaxed: the argmax) at the last node.

Randomness is an input (``coins``: one uniform per node), so kernel and reference agree exactly. The references
are the core rules (``sglang_spec.verify``) on the host tree structure (``TreeBatch``), reading the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
import triton
import triton.language as tl

from sglang_spec.sampling import TEMPERATURE_FLOOR, sample_from_probs, target_probs_from_logits
from sglang_spec.tree.batch import TreeBatch
from sglang_spec.verify.relaxed import RelaxedAcceptance, verify_relaxed_top_n
from sglang_spec.verify.result import VerifyResult
from sglang_spec.verify.target_only import verify_candidate_first
from sglang_spec.verify.walk import walk_matching_children

MODES = ("greedy", "sample", "relaxed")
ONE_BITS = 0x3F800000  # float32 1.0: tempered weights exp((x - max) / T) lie in (0, 1]
# In @triton.jit bodies a Python int literal becomes a Triton scalar with a `.to`; mypy only sees the int, hence the
# `type: ignore[attr-defined]` on those lines.
SEARCH_WAYS = 16  # thresholds tried a pass over the vocabulary by the top-k / top-p searches


def search_passes(ways: int, span: int = ONE_BITS + 1) -> int:
    """Passes a ``ways``-ary search needs to pin one value of ``span``: the ``ways`` candidates cut a width into
    ``ways + 1`` runs of at most ``ceil(width / (ways + 1))`` (8 passes for 16 ways; a bisection needs 30)."""
    passes = 0
    while span > 1:
        span, passes = -(-span // (ways + 1)), passes + 1
    return passes


@triton.jit
def _mass_at_least(row_ptr, V, best, inv_temperature, threshold, BLOCK_V: tl.constexpr):
    """Count and total of the tempered weights w = exp((x - best) * inv_temperature) with w >= threshold."""
    offsets = tl.arange(0, BLOCK_V)
    count = tl.zeros([BLOCK_V], dtype=tl.int32)
    mass = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        index = start + offsets
        x = tl.load(row_ptr + index, mask=index < V, other=-float("inf")).to(tl.float32)
        weight = tl.exp((x - best) * inv_temperature)
        keep = (weight >= threshold) & (index < V)
        count += keep.to(tl.int32)
        mass += tl.where(keep, weight, 0.0)
    return tl.sum(count, axis=0), tl.sum(mass, axis=0)


@triton.jit
def _masses_at_least(row_ptr, V, best, inv_temperature, thresholds, BLOCK_V: tl.constexpr, WAYS: tl.constexpr):
    """``_mass_at_least`` for every threshold of ``thresholds`` [WAYS] in one pass: counts [WAYS], masses [WAYS]."""
    offsets = tl.arange(0, BLOCK_V)
    count = tl.zeros([BLOCK_V, WAYS], dtype=tl.int32)
    mass = tl.zeros([BLOCK_V, WAYS], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        index = start + offsets
        x = tl.load(row_ptr + index, mask=index < V, other=-float("inf")).to(tl.float32)
        weight = tl.exp((x - best) * inv_temperature)
        keep = (weight[:, None] >= thresholds[None, :]) & (index < V)[:, None]
        count += keep.to(tl.int32)
        mass += tl.where(keep, weight[:, None], 0.0)
    return tl.sum(count, axis=0), tl.sum(mass, axis=0)


@triton.jit
def _narrow(low, high, holds, candidates):
    """One k-ary search step: ``candidates`` [WAYS] int64 ascending in [low, high], ``holds`` the (monotone:
    true up to the answer) predicate at each; returns the new [low, high] around the largest t that holds."""
    new_low = tl.max(tl.where(holds, candidates, low), axis=0)
    new_high = tl.min(tl.where(holds, high, candidates - 1), axis=0)
    return new_low, new_high


@triton.jit
def _target_tokens_kernel(
    logits_ptr,  # [B * N, V] float logits, row stride logits_stride
    logits_stride,
    temperature_ptr,  # [B] float32 (below GREEDY_BELOW, 0 included = greedy)
    top_k_ptr,  # [B] int64 (0 = off)
    top_p_ptr,  # [B] float32 (1 = off)
    coins_ptr,  # [B * N] float32 uniform in [0, 1)
    out_ptr,  # out [B * N] int64
    V,
    N: tl.constexpr,
    SAMPLE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SEARCH_BLOCK_V: tl.constexpr,  # the searches' block: each element is compared with WAYS thresholds at once
    WAYS: tl.constexpr,
    SEARCH: tl.constexpr,  # passes of a search: search_passes(WAYS)
    ONE: tl.constexpr,  # ONE_BITS
    GREEDY_BELOW: tl.constexpr,  # sampling.TEMPERATURE_FLOOR: 1 / T of a smaller T overflows float32
):
    # one program per tree node
    row = tl.program_id(0)
    request = row // N
    row_ptr = logits_ptr + row.to(tl.int64) * logits_stride
    offsets = tl.arange(0, BLOCK_V)
    best = -float("inf")
    best_index = 0
    for start in range(0, V, BLOCK_V):
        x = tl.load(row_ptr + start + offsets, mask=start + offsets < V, other=-float("inf")).to(tl.float32)
        block_best = tl.max(x, axis=0)
        block_index = start + tl.argmax(x, axis=0)
        best_index = tl.where(block_best > best, block_index, best_index)
        best = tl.maximum(best, block_best)
    token = best_index.to(tl.int64)  # type: ignore[attr-defined]
    if SAMPLE:
        temperature = tl.load(temperature_ptr + request)
        if temperature >= GREEDY_BELOW:
            inv_temperature = 1.0 / temperature
            top_k = tl.load(top_k_ptr + request)
            top_p = tl.load(top_p_ptr + request)
            coin = tl.load(coins_ptr + row)
            # top-k: the largest t (as float bits) with count(w >= t) >= k is exactly the k-th largest weight
            # (a k-ary search: WAYS thresholds a pass over the vocabulary, SEARCH passes pin the bit pattern)
            ways = tl.arange(0, WAYS).to(tl.int64) + 1
            kth = 0.0
            if (top_k > 0) & (top_k < V):
                low = tl.zeros([], dtype=tl.int64)
                high = tl.full([], ONE, dtype=tl.int64)
                for _ in range(SEARCH):
                    candidates = low + ways * (high - low + 1) // (WAYS + 1)
                    thresholds = candidates.to(tl.int32).to(tl.float32, bitcast=True)
                    k_counts, k_masses = _masses_at_least(row_ptr, V, best, inv_temperature, thresholds,
                                                          SEARCH_BLOCK_V, WAYS)
                    low, high = _narrow(low, high, k_counts >= top_k, candidates)
                kth = low.to(tl.int32).to(tl.float32, bitcast=True)
            # top-p: the largest t with mass(w >= max(t, kth)) >= top_p * mass(w >= kth)
            threshold = kth
            if top_p < 1.0:
                count, kept_mass = _mass_at_least(row_ptr, V, best, inv_temperature, kth, BLOCK_V)
                target = top_p * kept_mass
                low = tl.zeros([], dtype=tl.int64)
                high = tl.full([], ONE, dtype=tl.int64)
                for _ in range(SEARCH):
                    candidates = low + ways * (high - low + 1) // (WAYS + 1)
                    thresholds = tl.maximum(candidates.to(tl.int32).to(tl.float32, bitcast=True), kth)
                    p_counts, p_masses = _masses_at_least(row_ptr, V, best, inv_temperature, thresholds,
                                                          SEARCH_BLOCK_V, WAYS)
                    low, high = _narrow(low, high, p_masses >= target, candidates)
                threshold = tl.maximum(low.to(tl.int32).to(tl.float32, bitcast=True), kth)
            count, total = _mass_at_least(row_ptr, V, best, inv_temperature, threshold, BLOCK_V)
            # inverse CDF in token order: the first kept token whose running mass exceeds coin * total
            limit = coin * total
            carry = 0.0
            chosen = V
            last_kept = 0
            for start in range(0, V, BLOCK_V):
                index = start + offsets
                x = tl.load(row_ptr + index, mask=index < V, other=-float("inf")).to(tl.float32)
                weight = tl.exp((x - best) * inv_temperature)
                kept = (weight >= threshold) & (index < V)
                weight = tl.where(kept, weight, 0.0)
                running = tl.cumsum(weight, axis=0) + carry
                hit = tl.min(tl.where(kept & (running > limit), index, V), axis=0)
                chosen = tl.minimum(chosen, hit)
                last_kept = tl.maximum(last_kept, tl.max(tl.where(kept, index, 0), axis=0))
                carry += tl.sum(weight, axis=0)
            token = tl.where(chosen < V, chosen, last_kept).to(tl.int64)
    tl.store(out_ptr + row, token)


def _check_logits(logits: torch.Tensor, batch: int, nodes: int) -> None:
    if logits.dim() != 2 or logits.shape[0] != batch * nodes or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B * N, V] = [{batch * nodes}, V] with contiguous rows")


def target_tokens(
    logits: torch.Tensor,
    num_nodes_per_request: int,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    coins: torch.Tensor,
    sample: bool,
    out: torch.Tensor | None = None,
    block_v: int = 1024,
) -> torch.Tensor:
    """Launcher. logits [B * N, V]; temperature / top_p [B] float32, top_k [B] int64; coins [B * N] float32.
    ``sample=False`` takes the argmax everywhere (no sampling code compiled). Returns [B * N] int64."""
    batch = temperature.shape[0]
    _check_logits(logits, batch, num_nodes_per_request)
    out = out if out is not None else torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _target_tokens_kernel[(logits.shape[0],)](
        logits,
        logits.stride(0),
        temperature,
        top_k,
        top_p,
        coins,
        out,
        logits.shape[1],
        N=num_nodes_per_request,
        SAMPLE=sample,
        BLOCK_V=min(block_v, triton.next_power_of_2(logits.shape[1])),
        SEARCH_BLOCK_V=min(block_v, 256, triton.next_power_of_2(logits.shape[1])),
        WAYS=SEARCH_WAYS,
        SEARCH=search_passes(SEARCH_WAYS),
        ONE=ONE_BITS,
        GREEDY_BELOW=TEMPERATURE_FLOOR,
    )
    return out


def target_tokens_reference(
    logits: torch.Tensor,
    num_nodes_per_request: int,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    coins: torch.Tensor,
    sample: bool,
    out: torch.Tensor | None = None,
    block_v: int = 1024,
) -> torch.Tensor:
    batch = temperature.shape[0]
    _check_logits(logits, batch, num_nodes_per_request)
    grouped = logits.reshape(batch, num_nodes_per_request, -1)
    if sample:
        probs = target_probs_from_logits(grouped, temperature, top_k, top_p)
        result = sample_from_probs(probs, coins.reshape(batch, num_nodes_per_request)).reshape(-1)
        sampled = temperature.repeat_interleave(num_nodes_per_request) >= TEMPERATURE_FLOOR
        result = torch.where(sampled, result, logits.argmax(-1))
    else:
        result = logits.float().argmax(-1)
    out = out if out is not None else torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    return out.copy_(result)


@triton.jit
def _top_n_kernel(
    logits_ptr,  # [B * N, V] float logits
    logits_stride,
    tokens_ptr,  # out [B * N, TOP_N] int64, most likely first
    probs_ptr,  # out [B * N, TOP_N] float32 plain-softmax probabilities
    V,
    TOP_N: tl.constexpr,
    TOP_N_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # one program per tree node: online softmax normaliser, then TOP_N argmax passes excluding earlier picks
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * logits_stride
    offsets = tl.arange(0, BLOCK_V)
    running_max = -float("inf")
    running_sum = 0.0
    for start in range(0, V, BLOCK_V):
        x = tl.load(row_ptr + start + offsets, mask=start + offsets < V, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    slots = tl.arange(0, TOP_N_PAD)
    picked = tl.full([TOP_N_PAD], -1, dtype=tl.int32)
    for n in range(TOP_N):
        best = -float("inf")
        best_index = 0
        for start in range(0, V, BLOCK_V):
            index = start + offsets
            x = tl.load(row_ptr + index, mask=index < V, other=-float("inf")).to(tl.float32)
            taken = tl.max((index[:, None] == picked[None, :]).to(tl.int32), axis=1) > 0
            x = tl.where(taken, -float("inf"), x)
            block_best = tl.max(x, axis=0)
            block_index = start + tl.argmax(x, axis=0)
            best_index = tl.where(block_best > best, block_index, best_index)
            best = tl.maximum(best, block_best)
        picked = tl.where(slots == n, best_index, picked)
        tl.store(tokens_ptr + row * TOP_N + n, best_index.to(tl.int64))  # type: ignore[attr-defined]
        tl.store(probs_ptr + row * TOP_N + n, tl.exp(best - running_max) / running_sum)


def top_n_probs(
    logits: torch.Tensor, top_n: int, out: tuple[torch.Tensor, torch.Tensor] | None = None, block_v: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher. logits [R, V] -> (tokens [R, top_n] int64, probs [R, top_n] float32), most likely first."""
    rows, vocab = logits.shape
    if not 1 <= top_n <= min(vocab, 64):
        raise ValueError(f"top_n must be in [1, {min(vocab, 64)}], got {top_n}")
    tokens, probs = out if out is not None else (
        torch.empty(rows, top_n, dtype=torch.int64, device=logits.device),
        torch.empty(rows, top_n, dtype=torch.float32, device=logits.device),
    )
    _top_n_kernel[(rows,)](
        logits,
        logits.stride(0),
        tokens,
        probs,
        vocab,
        TOP_N=top_n,
        TOP_N_PAD=max(triton.next_power_of_2(top_n), 2),
        BLOCK_V=min(block_v, triton.next_power_of_2(vocab)),
    )
    return tokens, probs


def top_n_probs_reference(
    logits: torch.Tensor, top_n: int, out: tuple[torch.Tensor, torch.Tensor] | None = None, block_v: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    probs, tokens = torch.topk(torch.softmax(logits.float(), dim=-1), top_n, dim=-1)
    if out is None:
        return tokens, probs
    out[0].copy_(tokens)
    out[1].copy_(probs)
    return out


@triton.jit
def _node_normalizers_kernel(
    logits_ptr,  # [B * N, V] float logits, row stride logits_stride
    logits_stride,
    inverse_temperature_ptr,  # [B] float32 (1 / temperature)
    out_ptr,  # out [B * N, 2] float32: (max logit, sum of exp((x - max) * inverse temperature))
    V,
    N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # one program per tree node: the tempered softmax's maximum, then its sum, in two passes (the sum is taken
    # against the final maximum, so p(x) = exp((x - max) / T) / sum needs nothing else)
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * logits_stride
    inverse_temperature = tl.load(inverse_temperature_ptr + row // N)
    offsets = tl.arange(0, BLOCK_V)
    best = -float("inf")
    for start in range(0, V, BLOCK_V):
        x = tl.load(row_ptr + start + offsets, mask=start + offsets < V, other=-float("inf")).to(tl.float32)
        best = tl.maximum(best, tl.max(x, axis=0))
    total = 0.0
    for start in range(0, V, BLOCK_V):
        x = tl.load(row_ptr + start + offsets, mask=start + offsets < V, other=-float("inf")).to(tl.float32)
        total += tl.sum(tl.exp((x - best) * inverse_temperature), axis=0)
    tl.store(out_ptr + row * 2, best)
    tl.store(out_ptr + row * 2 + 1, total)


def node_normalizers(
    logits: torch.Tensor, num_nodes_per_request: int, inverse_temperature: torch.Tensor,
    out: torch.Tensor | None = None, block_v: int = 1024,
) -> torch.Tensor:
    """Launcher. logits [B * N, V]; inverse_temperature [B] float32 -> [B * N, 2] float32 (max logit, sum of the
    tempered exponentials), so p(x) = exp((x - max) * inverse_temperature) / sum at every node."""
    batch = inverse_temperature.shape[0]
    _check_logits(logits, batch, num_nodes_per_request)
    out = out if out is not None else torch.empty(logits.shape[0], 2, dtype=torch.float32, device=logits.device)
    _node_normalizers_kernel[(logits.shape[0],)](
        logits, logits.stride(0), inverse_temperature, out, logits.shape[1], N=num_nodes_per_request,
        BLOCK_V=min(block_v, triton.next_power_of_2(logits.shape[1])),
    )
    return out


def node_normalizers_reference(
    logits: torch.Tensor, num_nodes_per_request: int, inverse_temperature: torch.Tensor,
    out: torch.Tensor | None = None, block_v: int = 1024,
) -> torch.Tensor:
    batch = inverse_temperature.shape[0]
    _check_logits(logits, batch, num_nodes_per_request)
    x = logits.float()
    best = x.max(-1).values
    scale = inverse_temperature.float().repeat_interleave(num_nodes_per_request)
    total = torch.exp((x - best[:, None]) * scale[:, None]).sum(-1)
    result = torch.stack([best, total], dim=-1)
    out = out if out is not None else torch.empty_like(result)
    return out.copy_(result)


def node_probabilities(logits: torch.Tensor, num_nodes_per_request: int, inverse_temperature: torch.Tensor,
                       normalizers: torch.Tensor) -> torch.Tensor:
    """[B, N, V] float32 target probabilities exp((x - max) * inverse_temperature) / sum, the arithmetic the
    candidate-sampling walk applies to the tokens it reads."""
    batch = inverse_temperature.shape[0]
    scale = inverse_temperature.float().repeat_interleave(num_nodes_per_request)[:, None]
    probs = torch.exp((logits.float() - normalizers[:, :1]) * scale) / normalizers[:, 1:]
    return probs.reshape(batch, num_nodes_per_request, -1)


@dataclass(frozen=True, eq=False)
class AcceptOutputs:
    """Per-request results of ``accept_walk`` (D = max_depth).

    Fields:
      accepted_nodes: [B, D + 1] int64. Node ids on the accepted path, root first; -1 after accept_length and for
                      padded requests.
      accept_length:  [B] int64. Accepted drafts + 1 (bonus); 0 for a padded request.
      bonus_token:    [B] int64. -1 for a padded request.
      thinking:       [B] int8. Thinking state after the emitted tokens (relaxed mode; 0 in match mode).
    """

    accepted_nodes: torch.Tensor
    accept_length: torch.Tensor
    bonus_token: torch.Tensor
    thinking: torch.Tensor

    @classmethod
    def empty(cls, batch_size: int, max_depth: int, device: torch.device | str) -> AcceptOutputs:
        return cls(
            accepted_nodes=torch.empty(batch_size, max_depth + 1, dtype=torch.int64, device=device),
            accept_length=torch.empty(batch_size, dtype=torch.int64, device=device),
            bonus_token=torch.empty(batch_size, dtype=torch.int64, device=device),
            thinking=torch.empty(batch_size, dtype=torch.int8, device=device),
        )


@triton.jit
def _accept_walk_kernel(
    tokens_ptr,  # [B, N] int64 node tokens (-1 padding)
    parents_ptr,  # [B, N] int64 parents (-1 root / padding)
    num_nodes_ptr,  # [B] int64
    target_ptr,  # [B * N] int64 target token per node (match mode)
    top_tokens_ptr,  # [B * N, TOP_N] int64 (relaxed mode)
    top_probs_ptr,  # [B * N, TOP_N] float32 (relaxed mode)
    thinking_ptr,  # [B] int8 thinking state at the root (relaxed mode; not read in match mode)
    logits_ptr,  # [B * N, V] float target logits (sample mode)
    logits_stride,
    inverse_temperature_ptr,  # [B] float32 (sample mode)
    normalizers_ptr,  # [B * N, 2] float32 max logit and tempered sum per node (sample mode)
    coins_ptr,  # [B * N] float32, node v's coin decides among v's children (sample mode)
    final_coins_ptr,  # [B] float32, the bonus draw (sample mode)
    V,
    delta,  # relaxed probability slack inside thinking spans
    think_begin,
    think_end,
    accepted_ptr,  # out [B, MAX_DEPTH + 1] int64
    accept_length_ptr,  # out [B] int64
    bonus_ptr,  # out [B] int64
    thinking_out_ptr,  # out [B] int8
    output_ids_ptr,  # in/out [B, capacity] int64 per-request output buffer
    output_stride,
    output_capacity,
    output_lens_ptr,  # in/out [B] int64 tokens already in each output buffer
    N: tl.constexpr,
    N_PAD: tl.constexpr,
    MAX_DEPTH: tl.constexpr,
    D_PAD: tl.constexpr,
    RELAXED: tl.constexpr,
    SAMPLE: tl.constexpr,
    TOP_N: tl.constexpr,
    TOP_N_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # one program per request; every level looks at all nodes at once and picks the child to follow
    b = tl.program_id(0)
    nodes = tl.arange(0, N_PAD)
    count = tl.load(num_nodes_ptr + b)
    real = nodes < count
    tokens = tl.load(tokens_ptr + b * N + nodes, mask=real, other=-1)
    parents = tl.load(parents_ptr + b * N + nodes, mask=real & (nodes > 0), other=-1)
    steps = tl.arange(0, D_PAD)
    slots = tl.arange(0, TOP_N_PAD)
    active = count > 0
    current = 0
    accepted = 0
    path = tl.where((steps == 0) & active, 0, -1).to(tl.int64)
    emitted = tl.full([D_PAD], -1, dtype=tl.int64)
    if RELAXED:
        thinking = tl.load(thinking_ptr + b).to(tl.int32)
    for level in range(MAX_DEPTH):
        children = (parents == current) & real & active
        if RELAXED:
            row = (b * N + current).to(tl.int64) * TOP_N
            top_tokens = tl.load(top_tokens_ptr + row + slots, mask=slots < TOP_N, other=-2)
            top_probs = tl.load(top_probs_ptr + row + slots, mask=slots < TOP_N, other=0.0)
            first = tl.sum(tl.where(slots == 0, top_tokens, 0), axis=0)
            top_prob = tl.max(top_probs, axis=0)
            match = tokens[:, None] == top_tokens[None, :]
            in_top = tl.max(match.to(tl.int32), axis=1) > 0
            prob = tl.sum(tl.where(match, top_probs[None, :], 0.0), axis=1)
            slack = tl.where(thinking > 0, delta, 0.0)
            ok = children & in_top & ((tokens == first) | (prob >= top_prob - slack))
            score = tl.where(ok, prob, -1.0)
            best = tl.max(score, axis=0)
            chosen = tl.min(tl.where(ok & (score == best), nodes, N_PAD), axis=0)
        elif SAMPLE:
            row = (b * N + current).to(tl.int64)
            node_max = tl.load(normalizers_ptr + row * 2)
            node_sum = tl.load(normalizers_ptr + row * 2 + 1)
            scale = tl.load(inverse_temperature_ptr + b)
            x = tl.load(logits_ptr + row * logits_stride + tl.where(children, tokens, 0), mask=children,
                        other=-float("inf")).to(tl.float32)
            prob = tl.where(children, tl.exp((x - node_max) * scale) / node_sum, 0.0)
            # children in sibling (= index) order, each accepted when the coin falls in its bucket
            running = tl.cumsum(prob, axis=0)
            coin = tl.load(coins_ptr + row)
            chosen = tl.min(tl.where(children & (prob > 0) & (coin < running), nodes, N_PAD), axis=0)
        else:
            want = tl.load(target_ptr + b * N + current)
            chosen = tl.min(tl.where(children & (tokens == want), nodes, N_PAD), axis=0)
        moved = chosen < N_PAD
        token = tl.sum(tl.where(nodes == chosen, tokens, 0), axis=0)
        path = tl.where((steps == level + 1) & moved, chosen.to(tl.int64), path)
        emitted = tl.where((steps == level) & moved, token, emitted)
        if RELAXED:
            thinking = tl.where(moved & (token == think_begin), 1, thinking)
            thinking = tl.where(moved & (token == think_end), 0, thinking)
        current = tl.where(moved, chosen, current)
        accepted += moved.to(tl.int32)
        active = active & moved
    if RELAXED:
        bonus = tl.load(top_tokens_ptr + (b * N + current).to(tl.int64) * TOP_N)
    elif SAMPLE:
        # the target at the last node without its children (all tried, all rejected), by the final coin
        row = (b * N + current).to(tl.int64)
        row_ptr = logits_ptr + row * logits_stride
        node_max = tl.load(normalizers_ptr + row * 2)
        node_sum = tl.load(normalizers_ptr + row * 2 + 1)
        scale = tl.load(inverse_temperature_ptr + b)
        child_tokens = tl.where((parents == current) & real & (count > 0), tokens, -1)
        offsets = tl.arange(0, BLOCK_V)
        mass = 0.0
        for start in range(0, V, BLOCK_V):
            index = start + offsets
            x = tl.load(row_ptr + index, mask=index < V, other=-float("inf")).to(tl.float32)
            dropped = tl.max((index[:, None] == child_tokens[None, :]).to(tl.int32), axis=1) > 0
            weight = tl.where((index < V) & ~dropped, tl.exp((x - node_max) * scale) / node_sum, 0.0)
            mass += tl.sum(weight, axis=0)
        limit = tl.load(final_coins_ptr + b) * mass
        carry = 0.0
        hit = V
        last = -1
        for start in range(0, V, BLOCK_V):
            index = start + offsets
            x = tl.load(row_ptr + index, mask=index < V, other=-float("inf")).to(tl.float32)
            dropped = tl.max((index[:, None] == child_tokens[None, :]).to(tl.int32), axis=1) > 0
            weight = tl.where((index < V) & ~dropped, tl.exp((x - node_max) * scale) / node_sum, 0.0)
            running = tl.cumsum(weight, axis=0) + carry
            hit = tl.minimum(hit, tl.min(tl.where((weight > 0) & (running > limit), index, V), axis=0))
            last = tl.maximum(last, tl.max(tl.where(weight > 0, index, -1), axis=0))
            carry += tl.sum(weight, axis=0)
        bonus = tl.where(hit < V, hit, tl.where(last >= 0, last, V - 1)).to(tl.int64)
    else:
        bonus = tl.load(target_ptr + b * N + current)
    bonus = tl.where(count > 0, bonus, -1)
    if RELAXED:
        thinking = tl.where((count > 0) & (bonus == think_begin), 1, thinking)
        thinking = tl.where((count > 0) & (bonus == think_end), 0, thinking)
    length = tl.where(count > 0, accepted + 1, 0).to(tl.int64)
    emitted = tl.where(steps == accepted, bonus, emitted)
    tl.store(accepted_ptr + b * (MAX_DEPTH + 1) + steps, path, mask=steps < MAX_DEPTH + 1)
    tl.store(accept_length_ptr + b, length)
    tl.store(bonus_ptr + b, bonus)
    if RELAXED:
        tl.store(thinking_out_ptr + b, thinking.to(tl.int8))
    else:
        tl.store(thinking_out_ptr + b, 0)
    written = tl.load(output_lens_ptr + b)
    slot = written + steps
    tl.store(output_ids_ptr + b * output_stride + slot, emitted, mask=(steps < length) & (slot < output_capacity))
    tl.store(output_lens_ptr + b, tl.minimum(written + length, output_capacity))


@dataclass(frozen=True, eq=False)
class MatchMode:
    """Greedy and lossless sampling: follow the child whose token is the node's target token.

    Fields:
      target: [B * N] int64. The target's token at every node (``target_tokens``).
    """

    target: torch.Tensor


@dataclass(frozen=True, eq=False)
class RelaxedMode:
    """LOSSY opt-in: TensorRT-LLM's thinking-phase rule on the target's top-N at every node.

    Fields:
      top_tokens: [B * N, top_n] int64. The N most likely tokens per node, most likely first (``top_n_probs``).
      top_probs:  [B * N, top_n] float32. Their plain-softmax probabilities.
      thinking:   [B] int8. Whether each request is inside a thinking span at the root.
      rule:       the RelaxedAcceptance (top_n must equal the width of top_tokens).
    """

    top_tokens: torch.Tensor
    top_probs: torch.Tensor
    thinking: torch.Tensor
    rule: RelaxedAcceptance


@dataclass(frozen=True, eq=False)
class CandidateSampleMode:
    """Lossless sampling with SGLang's coin mapping (``verify_candidate_first``), temperature only.

    Fields:
      logits:              [B * N, V] float. The target's logits at every node.
      inverse_temperature: [B] float32. 1 / temperature (> 0) per request.
      normalizers:         [B * N, 2] float32. Each node's max logit and tempered sum (``node_normalizers``).
      coins:               [B * N] float32 uniform in [0, 1). Node v's coin decides among v's children.
      final_coins:         [B] float32 uniform in [0, 1). The bonus draw.
    """

    logits: torch.Tensor
    inverse_temperature: torch.Tensor
    normalizers: torch.Tensor
    coins: torch.Tensor
    final_coins: torch.Tensor


AcceptMode = Union[MatchMode, CandidateSampleMode, RelaxedMode]


def _check_walk_inputs(
    tokens: torch.Tensor, output_ids: torch.Tensor, output_lens: torch.Tensor, mode: AcceptMode
) -> None:
    batch, nodes = tokens.shape
    if output_ids.dim() != 2 or output_ids.shape[0] != batch or output_ids.stride(1) != 1:
        raise ValueError("output_ids must be [B, capacity] with contiguous rows")
    if output_lens.shape != (batch,):
        raise ValueError(f"output_lens must be [B] = [{batch}]")
    if isinstance(mode, MatchMode):
        if mode.target.shape != (batch * nodes,):
            raise ValueError(f"MatchMode.target must be [B * N] = [{batch * nodes}]")
    elif isinstance(mode, CandidateSampleMode):
        _check_logits(mode.logits, batch, nodes)
        if mode.normalizers.shape != (batch * nodes, 2) or mode.coins.shape != (batch * nodes,):
            raise ValueError(f"CandidateSampleMode normalizers / coins must be [B * N, 2] / [B * N] (B * N = "
                             f"{batch * nodes})")
        if mode.inverse_temperature.shape != (batch,) or mode.final_coins.shape != (batch,):
            raise ValueError(f"CandidateSampleMode inverse_temperature / final_coins must be [B] = [{batch}]")
    elif mode.top_tokens.shape != (batch * nodes, mode.rule.top_n) or mode.top_probs.shape != mode.top_tokens.shape:
        expected = f"[B * N, top_n] = [{batch * nodes}, {mode.rule.top_n}]"
        raise ValueError(f"RelaxedMode top_tokens / top_probs must be {expected}")


def accept_walk(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: torch.Tensor,
    max_depth: int,
    output_ids: torch.Tensor,
    output_lens: torch.Tensor,
    mode: AcceptMode,
    out: AcceptOutputs | None = None,
) -> AcceptOutputs:
    """Launcher. tokens / parents [B, N] int64, num_nodes [B] int64; ``mode`` says which rule and carries its
    inputs. output_ids [B, capacity] and output_lens [B] are updated in place."""
    _check_walk_inputs(tokens, output_ids, output_lens, mode)
    batch, nodes = tokens.shape
    out = out if out is not None else AcceptOutputs.empty(batch, max_depth, tokens.device)
    relaxed = isinstance(mode, RelaxedMode)
    sample = mode if isinstance(mode, CandidateSampleMode) else None
    # the pointers a mode does not use are never read; any int64 / float32 / int8 tensor stands in for them
    target = mode.target if isinstance(mode, MatchMode) else tokens
    top_tokens, top_probs = (mode.top_tokens, mode.top_probs) if isinstance(mode, RelaxedMode) else (tokens, tokens)
    rule = mode.rule if isinstance(mode, RelaxedMode) else None
    _accept_walk_kernel[(batch,)](
        tokens,
        parents,
        num_nodes,
        target,
        top_tokens,
        top_probs,
        mode.thinking if isinstance(mode, RelaxedMode) else out.thinking,
        sample.logits if sample else tokens,
        sample.logits.stride(0) if sample else 0,
        sample.inverse_temperature if sample else tokens,
        sample.normalizers if sample else tokens,
        sample.coins if sample else tokens,
        sample.final_coins if sample else tokens,
        sample.logits.shape[1] if sample else 1,
        rule.delta if rule else 0.0,
        rule.think_begin_token if rule else -1,
        rule.think_end_token if rule else -1,
        out.accepted_nodes,
        out.accept_length,
        out.bonus_token,
        out.thinking,
        output_ids,
        output_ids.stride(0),
        output_ids.shape[1],
        output_lens,
        N=nodes,
        N_PAD=max(triton.next_power_of_2(nodes), 2),
        MAX_DEPTH=max_depth,
        D_PAD=triton.next_power_of_2(max_depth + 1),
        RELAXED=relaxed,
        SAMPLE=sample is not None,
        TOP_N=rule.top_n if rule else 1,
        TOP_N_PAD=max(triton.next_power_of_2(rule.top_n), 2) if rule else 2,
        BLOCK_V=min(1024, triton.next_power_of_2(sample.logits.shape[1])) if sample else 16,
    )
    return out


def accept_walk_reference(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: torch.Tensor,
    max_depth: int,
    output_ids: torch.Tensor,
    output_lens: torch.Tensor,
    mode: AcceptMode,
    out: AcceptOutputs | None = None,
) -> AcceptOutputs:
    """The core rules on the host tree structure, reading the launcher's inputs: ``walk_matching_children``
    (match mode), ``verify_candidate_first`` on the same probabilities (sample mode) or ``verify_relaxed_top_n``
    on the same top-N (relaxed mode)."""
    _check_walk_inputs(tokens, output_ids, output_lens, mode)
    batch, nodes = tokens.shape
    trees = TreeBatch.from_parents(tokens.cpu(), parents.cpu(), num_nodes.cpu())
    if isinstance(mode, MatchMode):
        result = walk_matching_children(trees, mode.target.cpu().reshape(batch, nodes))
        thinking_after = torch.zeros(batch, dtype=torch.int8)
    elif isinstance(mode, CandidateSampleMode):
        probs = node_probabilities(mode.logits.cpu(), nodes, mode.inverse_temperature.cpu(), mode.normalizers.cpu())
        result = verify_candidate_first(trees, probs, mode.coins.cpu().reshape(batch, nodes), mode.final_coins.cpu())
        thinking_after = torch.zeros(batch, dtype=torch.int8)
    else:
        top_n = mode.rule.top_n
        outcome = verify_relaxed_top_n(
            trees,
            mode.top_tokens.cpu().reshape(batch, nodes, top_n),
            mode.top_probs.cpu().reshape(batch, nodes, top_n),
            mode.rule,
            mode.thinking.cpu().bool(),
        )
        result, thinking_after = outcome.result, outcome.thinking_after.to(torch.int8)
    out = out if out is not None else AcceptOutputs.empty(batch, max_depth, tokens.device)
    _write_outputs(result, thinking_after, max_depth, out)
    _append_emitted(result, output_ids, output_lens)
    return out


def _write_outputs(result: VerifyResult, thinking_after: torch.Tensor, max_depth: int, out: AcceptOutputs) -> None:
    batch = result.accept_length.shape[0]
    accepted = torch.full((batch, max_depth + 1), -1, dtype=torch.int64)
    width = min(result.accepted_nodes.shape[1], max_depth + 1)
    accepted[:, :width] = result.accepted_nodes[:, :width]
    out.accepted_nodes.copy_(accepted)
    out.accept_length.copy_(result.accept_length)
    out.bonus_token.copy_(result.bonus_token)
    out.thinking.copy_(thinking_after)


def _append_emitted(result: VerifyResult, output_ids: torch.Tensor, output_lens: torch.Tensor) -> None:
    """Appends each request's emitted tokens to its output buffer, as far as the buffer holds them."""
    capacity = output_ids.shape[1]
    for b in range(output_ids.shape[0]):
        written = int(output_lens[b])
        emitted = result.tokens(b)[: max(0, capacity - written)]
        output_ids[b, written : written + len(emitted)] = torch.tensor(emitted, dtype=output_ids.dtype)
        output_lens[b] = min(written + int(result.accept_length[b]), capacity)
