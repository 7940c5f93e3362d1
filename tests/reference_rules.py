"""Verification rules the decoder and the plugin do not run, kept as references the lossless and relaxed tests
check (and check against): Sequoia's SWOR and SpecInfer's i.i.d. rejection rules, Medusa's typical acceptance.

The rejection rules, for trees whose children were *sampled* from the draft distribution q:

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
from sglang_spec.sampling import TEMPERATURE_FLOOR, sample_from_probs
from sglang_spec.tree.batch import TreeBatch
from sglang_spec.verify.result import VerifyResult, finish
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


def rejection_step(target: torch.Tensor, draft: torch.Tensor, token: torch.Tensor,
                   rule: RejectionKind) -> RejectionStep:
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


def verify_typical(
    batch: TreeBatch, target_logits: torch.Tensor, temperature: float, epsilon: float, alpha: float
) -> VerifyResult:
    """Medusa typical acceptance (LOSSY): with p_T = softmax(logits / T), a node's token is acceptable when
    p_T(x) > min(epsilon, alpha * exp(-H(p_T))); the accepted path is the deepest node whose whole path is
    acceptable, ties broken by the larger summed log p_T, then the lower index. The bonus is the argmax.
    target_logits: [B, N, V]. temperature 0 reduces to greedy. Medusa's defaults: epsilon 0.09, alpha 0.3."""
    if not temperature >= 0:  # NaN too
        raise SpecError(f"temperature must be >= 0, got {temperature}")
    if epsilon <= 0 or alpha <= 0:
        raise SpecError("typical acceptance needs epsilon > 0 and alpha > 0 (Medusa: 0.09 and 0.3)")
    batch_size, max_nodes = batch.tokens.shape
    logits = target_logits.float()
    argmax = logits.argmax(-1)
    if temperature < TEMPERATURE_FLOOR:  # greedy, as everywhere (1 / T would overflow)
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
    path_node = best.clone()
    node_depth = torch.where(batch.num_nodes > 0, batch.depths[rows, best], -1)
    for level in range(depth, -1, -1):
        here = node_depth == level
        accepted[:, level] = torch.where(here, path_node, accepted[:, level])
        path_node = torch.where(here, batch.parents[rows, path_node].clamp(min=0), path_node)
        node_depth = torch.where(here, node_depth - 1, node_depth)
    return finish(batch, accepted, argmax[rows, best])
