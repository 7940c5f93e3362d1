"""Lossless sampling for deterministic candidate trees (MTP top-k): SpecExec's sample-and-match rule.

At every node draw ``y ~ p(. | node)`` from the target; accept the child whose token equals ``y`` and continue
there, else emit ``y`` and stop; at a leaf emit its ``y``. Each emitted token is an exact target sample, so the
output law equals sampling from the target, for any tree; the acceptance at a node with children S is p(S), the
most any rule can get with a fixed candidate set.
"""

from __future__ import annotations

import torch

from sglang_spec.sampling import sample_from_probs
from sglang_spec.tree.batch import TreeBatch
from sglang_spec.verify.result import VerifyResult
from sglang_spec.verify.walk import walk_matching_children


def verify_sample_match(batch: TreeBatch, target_probs: torch.Tensor, coins: torch.Tensor) -> VerifyResult:
    """target_probs: [B, N, V] sampling distribution at every node (after temperature / top-k / top-p).
    coins: [B, N] uniform in [0, 1), one per node; node v's draw is ``sample_from_probs(target_probs[v], coins[v])``.
    """
    return walk_matching_children(batch, sample_from_probs(target_probs, coins))
