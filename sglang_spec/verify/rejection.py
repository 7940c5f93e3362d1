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
from sglang_spec.verify.result import VerifyResult
from sglang_spec.verify.walk import WalkRule, walk

RejectionKind = Literal["swor", "iid"]


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


def rejection_step(target: torch.Tensor, draft: torch.Tensor, token: torch.Tensor, rule: RejectionKind) -> RejectionStep:
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


class RejectionRule(WalkRule):
    """Try the children in draw order; accept child x with its coin against min(1, p(x) / q(x)); on rejection the
    node's target and draft distributions become the residuals of ``rejection_step``. The bonus is drawn from the
    target distribution left at the last node (the residual when every child was rejected)."""

    def __init__(
        self,
        batch: TreeBatch,
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor,
        accept_coins: torch.Tensor,
        bonus_coins: torch.Tensor,
        rule: RejectionKind,
    ) -> None:
        self.tokens = batch.tokens
        self.target_probs = target_probs
        self.draft_probs = draft_probs
        self.accept_coins = accept_coins
        self.bonus_coins = bonus_coins
        self.rule = rule
        self.target = target_probs[:, 0].double()
        self.draft = draft_probs[:, 0].double()

    def enter(self, rows: torch.Tensor, node: torch.Tensor, active: torch.Tensor) -> None:
        # a request that stopped keeps the residual it stopped with: its bonus is drawn from it
        self.target = torch.where(active[:, None], self.target_probs[rows, node].double(), self.target)
        self.draft = torch.where(active[:, None], self.draft_probs[rows, node].double(), self.draft)

    def score(self, rows: torch.Tensor, node: torch.Tensor, child: torch.Tensor, trying: torch.Tensor) -> torch.Tensor:
        step = rejection_step(self.target, self.draft, self.tokens[rows, child].clamp(min=0), self.rule)
        accept = trying & (self.accept_coins[rows, child].double() < step.accept_probability)
        reject = trying & ~accept
        self.target = torch.where(reject[:, None], step.target_after_reject, self.target)
        self.draft = torch.where(reject[:, None], step.draft_after_reject, self.draft)
        return torch.where(accept, 0.0, -torch.inf).to(torch.float64)

    def bonus(self, rows: torch.Tensor, node: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        return sample_from_probs(self.target, self.bonus_coins[rows, node])


def verify_rejection(
    batch: TreeBatch,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    accept_coins: torch.Tensor,
    bonus_coins: torch.Tensor,
    rule: RejectionKind = "swor",
) -> VerifyResult:
    """Walks the tree with ``rule``.

    target_probs: [B, N, V] target sampling distribution at every node.
    draft_probs:  [B, N, V] the draft distribution each node's children were drawn from (children in increasing
                  index = draw order).
    accept_coins: [B, N] uniform in [0, 1); node v's coin decides v's own acceptance trial.
    bonus_coins:  [B, N] uniform in [0, 1); node v's coin draws the bonus when the walk stops at v.
    """
    if rule not in ("swor", "iid"):
        raise SpecError(f"unknown rejection rule {rule!r}; use 'swor' or 'iid'")
    return walk(batch, RejectionRule(batch, target_probs, draft_probs, accept_coins, bonus_coins, rule))
