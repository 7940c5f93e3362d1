"""The one chooser of how much a decode step verifies: ``plan_step`` (and ``choose_size`` under it).

A step verifies, for each request of the batch, a prefix of its best-first tree: its root and its best draft nodes
(parents before children; a node's reach is the probability that the target accepts it and every ancestor, as
the drafter's calibrated estimates give it). Verifying ``n`` tokens a request (root included) emits in expectation
``1 + the reach of its n - 1 best nodes`` tokens for each request, and costs the step ``seconds(n)``. The plan is
the size with the least predicted seconds per emitted token, under a cap on the step's time (which bounds the gap a
streaming client sees between two chunks); ``n = 1`` is a plain step (the root alone: the target's next token),
always allowed.

The reference decoder asks it per step with its tree's own reach at batch 1 over every size (``tree.best_first``);
the server asks it before each decode step with each request's predicted reach over the verify sizes it can run,
the ranks of a tensor-parallel group agreeing on its inputs first (``sglang_plugin.step_planner``): one chooser.

Where each request's verify forward covers its own tree (a ragged verify, ``sglang_plugin.ragged_verify``), a step
need not give every request the same size: ``plan_ragged`` takes the batch's draft nodes best first across its
requests, the step priced at the tokens it verifies, and gives each request its share (0: the request decodes
plainly in that step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class StepPlan:
    """tokens:            verify tokens a request this step (root included; 1: a plain step).
    expected_tokens:      tokens the step is predicted to emit, the batch's total.
    predicted_seconds:    the step's predicted time.
    nodes:                per request, the draft nodes it verifies (``min(tokens - 1, its tree's size)``)."""

    tokens: int
    expected_tokens: float
    predicted_seconds: float
    nodes: tuple[int, ...]

    @property
    def plain(self) -> bool:
        return self.tokens == 1

    def verify_tokens(self, ragged: bool) -> tuple[int, ...]:
        """Each request's verify tokens, root included: its share plus its root where the step is ragged, else the
        step's size for every request."""
        return tuple(1 + count for count in self.nodes) if ragged else (self.tokens,) * len(self.nodes)

    @property
    def seconds_per_token(self) -> float:
        return self.predicted_seconds / self.expected_tokens


@dataclass(frozen=True)
class SizeTable:
    """What each verify size would give the batch: ``sizes`` (ascending, 1 first), and for each the batch's
    ``expected`` emitted tokens and the step's predicted ``seconds``. The inputs the ranks of a group agree on."""

    sizes: tuple[int, ...]
    expected: tuple[float, ...]
    seconds: tuple[float, ...]


def expected_tokens(reach: Sequence[Sequence[float]], tokens: int) -> float:
    """The batch's expected emitted tokens when every request verifies ``tokens`` (root included): one each, plus
    the reach of each request's best ``tokens - 1`` nodes. A request's sum runs from 1 in list order, as the device
    trees' prefix choice sums it (``device_trees.hybrid``: a cumulative sum), so both choose the same prefix."""
    return math.fsum(_running_sum(nodes[: tokens - 1]) for nodes in reach)


def _running_sum(values: Sequence[float]) -> float:
    total = 1.0
    for value in values:
        total += value
    return total


def size_table(reach: Sequence[Sequence[float]], seconds: Callable[[int], float], sizes: Sequence[int]) -> SizeTable:
    """The table of every size in ``sizes`` (the plain step, 1, always included) for a batch whose requests' draft
    nodes have ``reach`` (per request, best first: a prefix of the list is a tree; may be empty)."""
    if not reach:
        raise ValueError("a step plans at least one request")
    ordered = tuple(sorted({1, *sizes}))
    if ordered[0] < 1:
        raise ValueError(f"verify sizes are whole numbers >= 1, got {ordered[0]}")
    return SizeTable(ordered, tuple(expected_tokens(reach, size) for size in ordered),
                     tuple(seconds(size) for size in ordered))


def choose_size(table: SizeTable, cap_seconds: float | None = None) -> tuple[int, float, float]:
    """(size, expected tokens, predicted seconds) of the size with the least seconds per token; a size whose step
    is predicted longer than ``cap_seconds`` is not taken, the plain step always is. Ties go to the smaller size."""
    best: tuple[int, float, float] | None = None
    for size, expected, time in zip(table.sizes, table.expected, table.seconds):
        if size > 1 and cap_seconds is not None and time > cap_seconds:
            continue
        if best is None or time / expected < best[2] / best[1]:
            best = (size, expected, time)
    assert best is not None  # the plain step is always a candidate
    return best


def plan_step(reach: Sequence[Sequence[float]], seconds: Callable[[int], float], sizes: Sequence[int],
              cap_seconds: float | None = None) -> StepPlan:
    """The plan of one step for a batch of ``len(reach)`` requests.

    reach:       per request, its draft nodes' reach, best first (a prefix of the list is a tree); may be empty.
    seconds:     the step's predicted seconds when every request verifies ``n`` tokens (root included).
    sizes:       the verify sizes the step may take (the plain step, 1, is always a candidate).
    cap_seconds: a size whose predicted step is longer is not taken (None: no cap); the plain step always is."""
    size, expected, time = choose_size(size_table(reach, seconds, sizes), cap_seconds)
    return StepPlan(size, expected, time, tuple(min(size - 1, len(nodes)) for nodes in reach))


def plan_ragged(reach: Sequence[Sequence[float]], seconds: Callable[[float], float], sizes: Sequence[int],
                cap_seconds: float | None = None) -> StepPlan:
    """The plan of one step whose requests verify their own number of nodes (a ragged verify).

    reach:       per request, its draft nodes' reach (taken best first; a request's share is its best nodes).
    seconds:     the step's predicted seconds when its requests verify ``t`` tokens each on average, root
                 included (a float; ``t`` 1: a plain step).
    sizes:       the widths a step may run at (ascending, 1 first): no request verifies more than the largest.
    cap_seconds: a step predicted longer is not taken (None: no cap); the plain step always is.

    The batch's nodes are taken best first across its requests (equal reach: the request with fewer taken so far,
    then the earlier); of the first
    m, the m with the least seconds per expected token wins (m = 0: a plain step). ``tokens`` is the smallest size
    that holds the largest share plus the root, ``nodes`` each request's share."""
    if not reach:
        raise ValueError("a step plans at least one request")
    batch = len(reach)
    widest = max(sizes)
    # (reach, rank within its request, request): equal reach goes to the request with fewer nodes so far
    slots = sorted((value, rank, row) for row, nodes in enumerate(reach)
                   for rank, value in enumerate(sorted(nodes, reverse=True)[: widest - 1]))
    slots.sort(key=lambda slot: -slot[0])  # stable: within equal reach, by rank, then request
    best, best_expected, best_time = 0, float(batch), seconds(1.0)
    expected = float(batch)
    for taken, (value, _, _) in enumerate(slots, start=1):
        expected += value
        time = seconds(1.0 + taken / batch)
        if cap_seconds is not None and time > cap_seconds:
            break  # the price only grows with the nodes taken
        if time / expected < best_time / best_expected:
            best, best_expected, best_time = taken, expected, time
    nodes = [0] * batch
    for _, _, row in slots[:best]:
        nodes[row] += 1
    return StepPlan(width_for(nodes, sizes), best_expected, best_time, tuple(nodes))


def width_for(nodes: Sequence[int], sizes: Sequence[int]) -> int:
    """The smallest of ``sizes`` that holds the largest of ``nodes`` plus its root; 1 (the plain step, always a
    candidate) where every share is 0."""
    needed = max(nodes, default=0) + 1
    return 1 if needed == 1 else min(size for size in sizes if size >= needed)
