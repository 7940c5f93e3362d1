"""The one tree walk every verification rule runs; a rule only says how it judges a child.

From the root, at every node the walk offers the node's children to the rule one at a time in increasing index
(first child, then next siblings: SGLang's order). The rule scores each child (-inf: not acceptable). A rule whose
``first_acceptable_wins`` is set stops at its first acceptable child (greedy, sample-and-match, the rejection
rules); otherwise every child is scored and the best wins, ties to the lower index (the relaxed rule). The walk
moves to the chosen child, or stops when none is acceptable or the node is a leaf; the rule then names the bonus
token at the last node. All requests advance together, one level per iteration; padded requests never move.

Rules:
* ``MatchRule``: accept the child whose token equals the target's token at the node (an argmax for greedy, a
  sample for SpecExec's sample-and-match); the bonus is that token at the last node.
* ``RelaxedRule`` (``verify/relaxed.py``); the test references ``RejectionRule`` (``tests/reference_rules.py``).
"""

from __future__ import annotations

import abc

import torch

from sglang_spec.tree.batch import TreeBatch
from sglang_spec.verify.result import VerifyResult, finish


class WalkRule(abc.ABC):
    """How a verification rule judges children. ``rows`` is ``arange(B)``; ``node`` / ``child`` are [B] int64 node
    ids (valid indices; meaningful where the walk says so)."""

    first_acceptable_wins: bool = True

    def enter(self, rows: torch.Tensor, node: torch.Tensor, active: torch.Tensor) -> None:
        """Called once per level before the children of ``node`` are offered; ``active`` [B] bool marks the
        requests still walking."""

    @abc.abstractmethod
    def score(self, rows: torch.Tensor, node: torch.Tensor, child: torch.Tensor, trying: torch.Tensor) -> torch.Tensor:
        """[B] float64 score of ``child`` of ``node`` where ``trying``; -inf where not acceptable."""

    def moved(self, token: torch.Tensor, moved: torch.Tensor) -> None:
        """Called after each level with the chosen child's token [B] where ``moved`` [B] bool."""

    @abc.abstractmethod
    def bonus(self, rows: torch.Tensor, node: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """[B] int64 token emitted after the last accepted node ``node``; ``real`` [B] marks non-padded requests."""


def walk(batch: TreeBatch, rule: WalkRule) -> VerifyResult:
    """Runs ``rule`` over every tree of ``batch``; padded requests are no-ops."""
    batch_size, max_nodes = batch.tokens.shape
    rows = torch.arange(batch_size, device=batch.device)
    real = batch.num_nodes > 0
    active = real.clone()
    current = torch.zeros(batch_size, dtype=torch.int64, device=batch.device)
    depth = batch.max_depth()
    accepted = torch.full((batch_size, depth + 1), -1, dtype=torch.int64, device=batch.device)
    accepted[:, 0] = torch.where(real, 0, -1)
    no_child = torch.full_like(current, -1)
    # one iteration per level, plus one at the deepest leaves (no children there; a rule may need to enter them)
    for level in range(depth + 1):
        rule.enter(rows, current, active)
        child = torch.where(active, batch.first_child[rows, current], no_child)
        chosen = no_child.clone()
        best = torch.full((batch_size,), -torch.inf, dtype=torch.float64, device=batch.device)
        for _ in range(max_nodes):
            trying = child >= 0
            if not bool(trying.any()):
                break
            safe = child.clamp(min=0)
            score = rule.score(rows, current, safe, trying)
            better = trying & (score > best)
            chosen = torch.where(better, child, chosen)
            best = torch.where(better, score, best)
            keep_looking = trying & ~better if rule.first_acceptable_wins else trying
            child = torch.where(keep_looking, batch.next_sibling[rows, safe], no_child)
        moved = chosen >= 0
        if level < depth:
            accepted[:, level + 1] = chosen
        rule.moved(batch.tokens[rows, chosen.clamp(min=0)], moved)
        current = torch.where(moved, chosen, current)
        active = active & moved
    return finish(batch, accepted, rule.bonus(rows, current, real))


class MatchRule(WalkRule):
    """Follow the child whose token equals ``target_tokens`` at the node; the bonus is the target token at the
    last node. target_tokens: [B, N] int64 (argmax for greedy, a sample for sample-and-match)."""

    def __init__(self, batch: TreeBatch, target_tokens: torch.Tensor) -> None:
        self.tokens = batch.tokens
        self.target_tokens = target_tokens

    def score(self, rows: torch.Tensor, node: torch.Tensor, child: torch.Tensor, trying: torch.Tensor) -> torch.Tensor:
        match = self.tokens[rows, child] == self.target_tokens[rows, node]
        return torch.where(match, 0.0, -torch.inf).to(torch.float64)

    def bonus(self, rows: torch.Tensor, node: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        return self.target_tokens[rows, node]


def walk_matching_children(batch: TreeBatch, target_tokens: torch.Tensor) -> VerifyResult:
    """From the root, repeatedly move to the first child whose token equals ``target_tokens`` at the current node;
    the bonus is ``target_tokens`` at the last node. target_tokens: [B, N] int64."""
    return walk(batch, MatchRule(batch, target_tokens))
