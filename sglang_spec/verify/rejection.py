"""Rejection rules for trees whose children were *sampled* from the draft distribution q.

At a node with target p and children x_1..x_k in draw order, try each child in turn: accept x_i with probability
min(1, p_i(x_i) / q_i(x_i)); on rejection p_{i+1} = norm((p_i - q_i)+) and

* ``swor`` (Sequoia, arXiv 2402.12374; also RSD): children drawn *without replacement*, so q_{i+1} is q_i with
  x_i removed and renormalised. The residual uses q_i *before* the removal. Lossless for SWOR drafts.
* ``iid`` (SpecInfer multi-step sampling): children drawn i.i.d. from q, q unchanged. Lossless for i.i.d.
  drafts only; applied to SWOR drafts it is biased (the negative control in the tests).

If every child is rejected (or the node is a leaf) the bonus token is drawn from the current p.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from sglang_spec.errors import SpecError
from sglang_spec.sampling import sample_from_probs
from sglang_spec.tree.batch import TreeBatch
from sglang_spec.verify.result import VerifyResult, finish

RejectionRule = Literal["swor", "iid"]


@dataclass(frozen=True, eq=False)
class RejectionStep:
    """One candidate trial for R rows.

    Fields:
      accept_probability: [R] float64, min(1, p(x) / q(x)).
      target_after_reject: [R, V] float64, norm((p - q)+) (p itself when that mass is 0).
      draft_after_reject:  [R, V] float64, q with x removed and renormalised (swor) or q (iid).
    """

    accept_probability: torch.Tensor
    target_after_reject: torch.Tensor
    draft_after_reject: torch.Tensor


def rejection_step(target: torch.Tensor, draft: torch.Tensor, token: torch.Tensor, rule: RejectionRule) -> RejectionStep:
    """target, draft: [R, V] float64 distributions; token: [R] int64 candidate drawn from ``draft``."""
    rows = torch.arange(target.shape[0], device=target.device)
    target_at = target[rows, token]
    draft_at = draft[rows, token]
    accept_probability = torch.where(
        draft_at > 0, torch.clamp(target_at / draft_at.clamp(min=1e-300), max=1.0), (target_at > 0).double()
    )
    residual = (target - draft).clamp(min=0)
    residual_mass = residual.sum(-1, keepdim=True)
    # p <= q everywhere means p == q: acceptance was certain, so the residual is never sampled; keep p finite.
    target_after = torch.where(residual_mass > 0, residual / residual_mass.clamp(min=1e-300), target)
    if rule == "swor":
        removed = draft.clone()
        removed[rows, token] = 0
        mass = removed.sum(-1, keepdim=True)
        draft_after = torch.where(mass > 0, removed / mass.clamp(min=1e-300), removed)
    elif rule == "iid":
        draft_after = draft
    else:
        raise SpecError(f"unknown rejection rule {rule!r}; use 'swor' or 'iid'")
    return RejectionStep(accept_probability, target_after, draft_after)


def verify_rejection(
    batch: TreeBatch,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    accept_coins: torch.Tensor,
    bonus_coins: torch.Tensor,
    rule: RejectionRule = "swor",
) -> VerifyResult:
    """Walks the tree with ``rule``.

    target_probs: [B, N, V] target sampling distribution at every node.
    draft_probs:  [B, N, V] the draft distribution each node's children were drawn from (children in increasing
                  index = draw order).
    accept_coins: [B, N] uniform in [0, 1); node v's coin decides v's own acceptance trial.
    bonus_coins:  [B, N] uniform in [0, 1); node v's coin draws the bonus when the walk stops at v.
    """
    batch_size, max_nodes = batch.tokens.shape
    rows = torch.arange(batch_size, device=batch.device)
    active = batch.num_nodes > 0
    current = torch.zeros(batch_size, dtype=torch.int64, device=batch.device)
    depth = batch.max_depth()
    accepted = torch.full((batch_size, depth + 1), -1, dtype=torch.int64, device=batch.device)
    accepted[:, 0] = torch.where(active, 0, -1)
    final_target = target_probs[:, 0].double().clone()
    for level in range(depth + 1):
        target = target_probs[rows, current].double()
        draft = draft_probs[rows, current].double()
        child = torch.where(active, batch.first_child[rows, current], -1)
        chosen = torch.full_like(child, -1)
        for _ in range(max_nodes):
            trying = child >= 0
            if not bool(trying.any()):
                break
            safe = child.clamp(min=0)
            step = rejection_step(target, draft, batch.tokens[rows, safe].clamp(min=0), rule)
            accept = trying & (accept_coins[rows, safe].double() < step.accept_probability)
            reject = trying & ~accept
            chosen = torch.where(accept, child, chosen)
            target = torch.where(reject[:, None], step.target_after_reject, target)
            draft = torch.where(reject[:, None], step.draft_after_reject, draft)
            child = torch.where(reject, batch.next_sibling[rows, safe], torch.full_like(child, -1))
        moved = chosen >= 0
        stopping = active & ~moved
        final_target = torch.where(stopping[:, None], target, final_target)
        if level < depth:
            accepted[:, level + 1] = chosen
        current = torch.where(moved, chosen, current)
        active = active & moved
    bonus = sample_from_probs(final_target, bonus_coins[rows, current])
    return finish(batch, accepted, bonus)
