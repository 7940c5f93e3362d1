"""SGLang's target-only sampling rule (``tree_speculative_sampling_target_only`` with thresholds 1): lossless
sampling for deterministic candidate trees, inverse-CDF from the target with the node's candidates' buckets first.

At a node with children x_1..x_k (sibling order) and coin u: accept x_i when p(x_i) > 0 and u < p(x_1) + ... +
p(x_i) (float32 running sum, in that order), and continue at x_i with x_i's own coin; when no child is accepted
(or the node is a leaf), the bonus token is drawn from the target with the node's children removed, by the
request's final coin: the first token whose running residual mass exceeds ``final_coin * total``. Child i is
accepted with probability p(x_i), and the residual draw returns any other token y with probability
(1 - p(S)) * p(y) / (1 - p(S)) = p(y): every emitted token is an exact target sample, for any candidate set.

Same law as sample-and-match (``verify/sample_match.py``), different coin-to-token mapping; the plugin's fused
accept uses this one so its outputs equal SGLang's own for the same coins.
"""

from __future__ import annotations

import torch

from sglang_spec.tree.batch import TreeBatch
from sglang_spec.verify.result import VerifyResult
from sglang_spec.verify.walk import WalkRule, walk


def first_above(weights: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """weights [R, V] >= 0, coins [R] -> [R] int64: per row the first index whose running sum exceeds
    coin * total (among positive weights); the last positive index when rounding leaves none; V - 1 when a row
    has no mass."""
    running = torch.cumsum(weights, dim=-1)
    limit = coins.to(running.dtype)[:, None] * running[:, -1:]
    vocab = weights.shape[-1]
    index = torch.arange(vocab, device=weights.device)
    hit = torch.where((running > limit) & (weights > 0), index, vocab).min(-1).values
    last_positive = torch.where(weights > 0, index, -1).max(-1).values
    return torch.where(hit < vocab, hit, torch.where(last_positive >= 0, last_positive, vocab - 1))


class CandidateFirstRule(WalkRule):
    """target_probs [B, N, V] float32 at every node; coins [B, N]; final_coins [B]."""

    def __init__(self, batch: TreeBatch, target_probs: torch.Tensor, coins: torch.Tensor, final_coins: torch.Tensor):
        self.batch = batch
        self.target_probs = target_probs.float()
        self.coins = coins.float()
        self.final_coins = final_coins.float()
        self.running = torch.zeros(batch.batch_size, dtype=torch.float32, device=batch.device)
        self.coin = torch.zeros(batch.batch_size, dtype=torch.float32, device=batch.device)

    def enter(self, rows: torch.Tensor, node: torch.Tensor, active: torch.Tensor) -> None:
        self.running = torch.zeros_like(self.running)
        self.coin = self.coins[rows, node]

    def score(self, rows: torch.Tensor, node: torch.Tensor, child: torch.Tensor, trying: torch.Tensor) -> torch.Tensor:
        token = torch.where(trying, self.batch.tokens[rows, child], 0)  # rows not trying may point at any node
        prob = self.target_probs[rows, node, token]
        self.running = torch.where(trying, self.running + prob, self.running)
        accept = trying & (prob > 0) & (self.coin < self.running)
        return torch.where(accept, 0.0, -torch.inf).to(torch.float64)

    def bonus(self, rows: torch.Tensor, node: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        residual = self.target_probs[rows, node].clone()  # [B, V]
        children = (self.batch.parents == node[:, None]) & (self.batch.parents >= 0)  # [B, N]
        tokens = torch.where(children, self.batch.tokens, torch.zeros_like(self.batch.tokens))
        drop = torch.zeros(residual.shape, dtype=torch.int32, device=residual.device)
        drop.scatter_add_(1, tokens, children.to(torch.int32))  # add, not set: non-children also point at token 0
        residual = residual.masked_fill(drop > 0, 0.0)
        return first_above(residual, self.final_coins)


def verify_candidate_first(batch: TreeBatch, target_probs: torch.Tensor, coins: torch.Tensor,
                           final_coins: torch.Tensor) -> VerifyResult:
    """target_probs: [B, N, V] sampling distribution at every node; coins: [B, N] uniform in [0, 1), node v's
    coin decides among v's children; final_coins: [B] uniform, the bonus draw."""
    return walk(batch, CandidateFirstRule(batch, target_probs, coins, final_coins))
