"""LOSSY relaxed acceptance. These rules change the output distribution and exist only as an explicit opt-in.

* ``verify_relaxed_topn_delta`` (TensorRT-LLM ``use_relaxed_acceptance_for_thinking``, for DeepSeek-R1): with
  pi = softmax(logits) (plain softmax, no temperature), a draft d is accepted when it is among the top-N of pi and
  (it is the argmax, or pi(d) >= pi(argmax) - delta). delta applies inside the thinking span only (between
  ``<think>`` and ``</think>``); outside it delta is 0, so only the argmax (or an exact tie) passes. On a tree,
  among the acceptable children the one with the highest pi wins (ties: lower index), which is the greedy child
  whenever it is present. The bonus is the argmax.
* ``verify_typical`` (Medusa typical acceptance): with p_T = softmax(logits / T), a node's token is acceptable when
  p_T(x) > min(epsilon, alpha * exp(-H(p_T))); the accepted path is the deepest node whose whole path is
  acceptable, ties broken by the larger summed log p_T, then the lower index. The bonus is the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_spec.errors import SpecError
from sglang_spec.tree.batch import TreeBatch
from sglang_spec.verify.result import VerifyResult, finish

LOSSY = True  # everything in this module


@dataclass(frozen=True, eq=False)
class RelaxedVerifyResult:
    """A VerifyResult plus each request's thinking state after its emitted tokens ([B] bool)."""

    result: VerifyResult
    thinking_after: torch.Tensor


def verify_relaxed_topn_delta(
    batch: TreeBatch,
    target_logits: torch.Tensor,
    top_n: int,
    delta: float,
    thinking: torch.Tensor,
    think_begin_token: int,
    think_end_token: int,
) -> RelaxedVerifyResult:
    """target_logits: [B, N, V]; thinking: [B] bool, whether each request is inside a thinking span at the root.
    The state toggles on ``think_begin_token`` / ``think_end_token`` among the accepted tokens and the bonus."""
    if top_n < 1:
        raise SpecError(f"relaxed top_n must be >= 1, got {top_n}")
    if not (0 <= delta <= 1):
        raise SpecError(f"relaxed delta is a probability difference in [0, 1], got {delta}")
    batch_size, max_nodes = batch.tokens.shape
    rows = torch.arange(batch_size, device=batch.device)
    probs = torch.softmax(target_logits.float(), dim=-1)
    top_probs, top_tokens = torch.topk(probs, min(top_n, probs.shape[-1]), dim=-1)
    argmax = top_tokens[..., 0]
    active = batch.num_nodes > 0
    state = thinking.clone().bool()
    current = torch.zeros(batch_size, dtype=torch.int64, device=batch.device)
    depth = batch.max_depth()
    accepted = torch.full((batch_size, depth + 1), -1, dtype=torch.int64, device=batch.device)
    accepted[:, 0] = torch.where(active, 0, -1)
    for level in range(depth):
        node_probs = probs[rows, current]
        node_top = top_tokens[rows, current]
        top1 = top_probs[rows, current, 0]
        request_delta = torch.where(state, torch.full_like(top1, delta), torch.zeros_like(top1))
        child = torch.where(active, batch.first_child[rows, current], -1)
        chosen = torch.full_like(child, -1)
        chosen_prob = torch.full_like(top1, -1.0)
        for _ in range(max_nodes):
            looking = child >= 0
            if not bool(looking.any()):
                break
            safe = child.clamp(min=0)
            token = batch.tokens[rows, safe].clamp(min=0)
            token_prob = node_probs[rows, token]
            in_top = (node_top == token[:, None]).any(-1)
            ok = looking & in_top & ((token == argmax[rows, current]) | (token_prob >= top1 - request_delta))
            better = ok & (token_prob > chosen_prob)
            chosen = torch.where(better, child, chosen)
            chosen_prob = torch.where(better, token_prob, chosen_prob)
            child = torch.where(looking, batch.next_sibling[rows, safe], child)
        moved = chosen >= 0
        accepted[:, level + 1] = chosen
        token = batch.tokens[rows, chosen.clamp(min=0)]
        state = _toggle(state, token, moved, think_begin_token, think_end_token)
        current = torch.where(moved, chosen, current)
        active = active & moved
    bonus = argmax[rows, current]
    state = _toggle(state, bonus, batch.num_nodes > 0, think_begin_token, think_end_token)
    return RelaxedVerifyResult(finish(batch, accepted, bonus), state)


def _toggle(state: torch.Tensor, token: torch.Tensor, emitted: torch.Tensor, begin: int, end: int) -> torch.Tensor:
    state = torch.where(emitted & (token == begin), torch.ones_like(state), state)
    return torch.where(emitted & (token == end), torch.zeros_like(state), state)


def verify_typical(
    batch: TreeBatch, target_logits: torch.Tensor, temperature: float, epsilon: float, alpha: float
) -> VerifyResult:
    """target_logits: [B, N, V]. temperature 0 reduces to greedy. Medusa's defaults: epsilon 0.09, alpha 0.3."""
    if temperature < 0:
        raise SpecError(f"temperature must be >= 0, got {temperature}")
    if epsilon <= 0 or alpha <= 0:
        raise SpecError("typical acceptance needs epsilon > 0 and alpha > 0 (Medusa: 0.09 and 0.3)")
    batch_size, max_nodes = batch.tokens.shape
    logits = target_logits.float()
    argmax = logits.argmax(-1)
    if temperature == 0:
        probs = torch.nn.functional.one_hot(argmax, logits.shape[-1]).float()
    else:
        probs = torch.softmax(logits / temperature, dim=-1)
    entropy = -(probs * torch.log(probs.clamp(min=1e-30))).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), alpha * torch.exp(-entropy))
    rows = torch.arange(batch_size, device=batch.device)
    path_ok = torch.zeros(batch_size, max_nodes, dtype=torch.bool, device=batch.device)
    path_ok[:, 0] = batch.num_nodes > 0
    path_score = torch.zeros(batch_size, max_nodes, dtype=torch.float64, device=batch.device)
    for node in range(1, max_nodes):
        parent = batch.parents[:, node]
        real = parent >= 0
        safe_parent = parent.clamp(min=0)
        token = batch.tokens[:, node].clamp(min=0)
        token_prob = probs[rows, safe_parent, token]
        ok = real & path_ok[rows, safe_parent] & (token_prob > threshold[rows, safe_parent])
        path_ok[:, node] = ok
        path_score[:, node] = torch.where(
            ok, path_score[rows, safe_parent] + torch.log(token_prob.double().clamp(min=1e-300)), 0.0
        )
    # deepest acceptable node; then larger summed log-prob; then lower index
    depth_key = torch.where(path_ok, batch.depths, torch.full_like(batch.depths, -1)).double()
    best_depth = depth_key.max(-1, keepdim=True).values
    candidate = path_ok & (depth_key == best_depth)
    score = torch.where(candidate, path_score, torch.full_like(path_score, -torch.inf))
    best = score.argmax(-1)
    depth = batch.max_depth()
    accepted = torch.full((batch_size, depth + 1), -1, dtype=torch.int64, device=batch.device)
    node = best.clone()
    node_depth = torch.where(batch.num_nodes > 0, batch.depths[rows, best], -1)
    for level in range(depth, -1, -1):
        here = node_depth == level
        accepted[:, level] = torch.where(here, node, accepted[:, level])
        node = torch.where(here, batch.parents[rows, node].clamp(min=0), node)
        node_depth = torch.where(here, node_depth - 1, node_depth)
    return finish(batch, accepted, argmax[rows, best])
