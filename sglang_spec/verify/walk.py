"""The tree walk shared by the rules that pick one target token per node and follow the matching child."""

from __future__ import annotations

import torch

from sglang_spec.tree.batch import TreeBatch
from sglang_spec.verify.result import VerifyResult, finish


def walk_matching_children(batch: TreeBatch, target_tokens: torch.Tensor) -> VerifyResult:
    """From the root, repeatedly move to the first child (in increasing index) whose token equals
    ``target_tokens`` at the current node; stop when none does. The bonus is ``target_tokens`` at the last node.

    target_tokens: [B, N] int64, the target's token at every node (argmax for greedy, a sample for sampling).
    """
    batch_size, max_nodes = batch.tokens.shape
    rows = torch.arange(batch_size, device=batch.device)
    active = batch.num_nodes > 0
    current = torch.zeros(batch_size, dtype=torch.int64, device=batch.device)
    depth = batch.max_depth()
    accepted = torch.full((batch_size, depth + 1), -1, dtype=torch.int64, device=batch.device)
    accepted[:, 0] = torch.where(active, 0, -1)
    for level in range(depth):
        want = target_tokens[rows, current]
        child = torch.where(active, batch.first_child[rows, current], -1)
        chosen = torch.full_like(child, -1)
        for _ in range(max_nodes):
            searching = child >= 0
            if not bool(searching.any()):
                break
            safe = child.clamp(min=0)
            match = searching & (batch.tokens[rows, safe] == want)
            chosen = torch.where(match, child, chosen)
            child = torch.where(searching & ~match, batch.next_sibling[rows, safe], torch.full_like(child, -1))
        moved = chosen >= 0
        accepted[:, level + 1] = chosen
        current = torch.where(moved, chosen, current)
        active = active & moved
    return finish(batch, accepted, target_tokens[rows, current])
