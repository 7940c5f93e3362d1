"""Greedy (temperature 0) tree verification: the output equals the target's own greedy decode."""

from __future__ import annotations

import torch

from sglang_spec.tree.batch import TreeBatch
from sglang_spec.verify.result import VerifyResult
from sglang_spec.verify.walk import walk_matching_children


def verify_greedy(batch: TreeBatch, target_predict: torch.Tensor) -> VerifyResult:
    """Accepts the child equal to the target's argmax at each node; the bonus is the argmax at the last node.

    target_predict: [B, N] int64, ``target_logits.argmax(-1)`` at every tree node (SGLang's target_predict).
    Same decisions as SGLang's ``verify_tree_greedy``: children are scanned first child, then siblings.
    """
    return walk_matching_children(batch, target_predict)
