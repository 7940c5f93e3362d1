"""Lossless sampling for deterministic candidate trees (MTP top-k): SpecExec's sample-and-match rule.

At every node draw ``y ~ p(. | node)`` from the target; accept the child whose token equals ``y`` and continue
there, else emit ``y`` and stop; at a leaf emit its ``y``. Each emitted token is an exact target sample, so the
output law equals sampling from the target, for any tree; the acceptance at a node with children S is p(S), the
most any rule can get with a fixed candidate set.
"""

from __future__ import annotations

import torch

from sglang_spec.sampling import sample_from_probs, target_probs_from_logits
from sglang_spec.tree.batch import TreeBatch
from sglang_spec.verify.result import VerifyResult
from sglang_spec.verify.walk import MatchRule, walk, walk_matching_children


def verify_sample_match(batch: TreeBatch, target_probs: torch.Tensor, coins: torch.Tensor) -> VerifyResult:
    """target_probs: [B, N, V] sampling distribution at every node (after temperature / top-k / top-p).
    coins: [B, N] uniform in [0, 1), one per node; node v's draw is ``sample_from_probs(target_probs[v], coins[v])``.
    """
    return walk_matching_children(batch, sample_from_probs(target_probs, coins))


def verify_sample_match_on_path(
    batch: TreeBatch, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    coins: torch.Tensor,
) -> VerifyResult:
    """``verify_sample_match`` with each node's distribution made and sampled only when the walk reaches the node.

    logits: [B, N, V]; temperature / top_k / top_p: [B] (``target_probs_from_logits``); coins: [B, N]. The result
    is identical to ``verify_sample_match(batch, target_probs_from_logits(logits, ...), coins)``: a node's draw
    depends on its own logits and coin only. The work is one distribution per node on the accepted path (plus the
    last), not one per node: a 16-node tree that accepts two tokens turns 3 rows of logits into distributions
    instead of 16.
    """
    return walk(batch, _SampleOnVisit(batch, logits, (temperature, top_k, top_p), coins))


class _SampleOnVisit(MatchRule):
    """MatchRule whose target token at a node is drawn when the walk enters the node."""

    def __init__(self, batch: TreeBatch, logits: torch.Tensor, params: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 coins: torch.Tensor) -> None:
        super().__init__(batch, torch.full_like(batch.tokens, -1))
        self.logits = logits
        self.params = params
        self.coins = coins

    def enter(self, rows: torch.Tensor, node: torch.Tensor, active: torch.Tensor) -> None:
        if not bool(active.any()):
            return
        visiting, at = rows[active], node[active]
        temperature, top_k, top_p = (param[visiting.to(param.device)] for param in self.params)
        probs = target_probs_from_logits(self.logits[visiting, at][:, None], temperature, top_k, top_p)[:, 0]
        self.target_tokens[visiting, at] = (sample_from_probs(probs, self.coins[visiting, at])
                                            .to(self.target_tokens.dtype))
