"""Sequoia's dynamic program: the static tree topology with the largest expected accept length F(T) under a
positional acceptance profile, for a node budget and a depth limit (arXiv 2402.12374, ``tree_search.py``).

State ``T[m, l, b]`` = best F over trees with exactly m nodes (root included), at most l levels (root included)
and a root with exactly b children:

* ``T[1, l, 0] = 1``
* ``T[m, l, 1] = 1 + p[1] * max_b' T[m-1, l-1, b']``
* ``T[m, l, b] = max_{y=1..m-1} T[y, l, b-1] + p[b] * max_b' T[m-y, l-1, b']`` (root + first b-1 subtrees use y
  nodes, the b-th child's subtree the other m-y)

Numerics follow the reference implementation: float32, the first y that is strictly better in ascending order,
first-index argmax. With a per-depth profile the children of a node with l levels left sit at depth D-l+1.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from sglang_spec.errors import SpecError
from sglang_spec.tree.profile import AcceptanceProfile


@dataclass(frozen=True, eq=False)
class SequoiaTable:
    """The DP for one profile, up to ``max_nodes`` nodes and exactly ``levels`` levels (depth ``levels - 1``).

    Fields:
      values:       [max_nodes + 1, levels + 1, max_branch + 1] float32, T[m, l, b]; -inf where infeasible.
      best_split:   [max_nodes + 1, levels + 1, max_branch + 1] int64, the y chosen for T[m, l, b] (b >= 2); -1 unset.
      levels:       the level count D the per-depth profile rows were laid out for.
    """

    values: np.ndarray
    best_split: np.ndarray
    levels: int

    @property
    def max_nodes(self) -> int:
        return self.values.shape[0] - 1

    def best_value(self, num_nodes: int, levels: int | None = None) -> float:
        """R[m, l] = max_b T[m, l, b] (float32 value as a Python float; -inf when infeasible)."""
        return float(self.values[num_nodes, self.levels if levels is None else levels].max())

    def parents(self, num_nodes: int) -> list[int]:
        """Parent list (parents-first, breadth-first like Sequoia's growmap) of the optimal tree with
        ``num_nodes`` nodes and at most ``self.levels`` levels. Children of a node are in rank order."""
        values = self.values
        if not np.isfinite(values[num_nodes, self.levels].max()):
            raise SpecError(f"no tree with {num_nodes} nodes fits in {self.levels} levels")
        states = [(num_nodes, self.levels, int(values[num_nodes, self.levels].argmax()))]
        parents = [-1]
        frontier = [0]
        while frontier:
            next_frontier = []
            for node in frontier:
                for child_state in self._child_states(*states[node]):
                    parents.append(node)
                    states.append(child_state)
                    next_frontier.append(len(parents) - 1)
            frontier = next_frontier
        assert len(parents) == num_nodes, (len(parents), num_nodes)
        return parents

    def _child_states(self, num_nodes: int, levels: int, branches: int) -> list[tuple[int, int, int]]:
        """Rank-ordered (nodes, levels, branches) states of a node's child subtrees (Sequoia's branch_map)."""
        result: list[tuple[int, int, int]] = []
        while branches > 0:
            # with one child left, the root alone remains (y = 1); otherwise the DP's recorded split
            split = 1 if branches == 1 else int(self.best_split[num_nodes, levels, branches])
            child_nodes = num_nodes - split
            result.append((child_nodes, levels - 1, int(self.values[child_nodes, levels - 1].argmax())))
            num_nodes, branches = split, branches - 1
        return result[::-1]


def sequoia_table(profile: AcceptanceProfile, max_nodes: int, levels: int,
                  max_branch: int | None = None) -> SequoiaTable:
    """Runs the DP for all node counts up to ``max_nodes`` with ``levels`` levels (cached per profile)."""
    branch = profile.max_rank if max_branch is None else min(max_branch, profile.max_rank)
    rows = tuple(profile.row(depth)[:branch] for depth in range(1, levels + 1))
    return _sequoia_table(rows, max_nodes, levels)


@functools.lru_cache(maxsize=64)
def _sequoia_table(rows: tuple[tuple[float, ...], ...], max_nodes: int, levels: int) -> SequoiaTable:
    max_branch = len(rows[0])
    values = np.full((max_nodes + 1, levels + 1, max_branch + 1), -np.inf, dtype=np.float32)
    best_split = np.full(values.shape, -1, dtype=np.int64)
    best_over_branches = np.full((max_nodes + 1, levels + 1), -np.inf, dtype=np.float32)
    values[1, 1:, 0] = 1.0
    best_over_branches[1, 1:] = 1.0

    node_count = np.arange(max_nodes + 1)
    split = node_count[None, :]  # y
    remainder = node_count[:, None] - split  # m - y
    valid_split = (split >= 1) & (remainder >= 1)
    remainder_index = np.clip(remainder, 0, max_nodes)

    for level in range(2, levels + 1):
        # children of a node with `level` levels left sit at depth levels - level + 1 (1-based profile rows)
        accept = np.asarray(rows[levels - level], dtype=np.float32)
        child_best = best_over_branches[:, level - 1]
        child_feasible = np.isfinite(child_best)
        for branches in range(1, max_branch + 1):
            # p[b] * max_b' T[., l-1, b'] in float32; an infeasible subtree stays -inf even when p[b] == 0
            with np.errstate(invalid="ignore"):
                weighted = np.where(child_feasible, accept[branches - 1] * child_best, -np.inf).astype(np.float32)
            if branches == 1:
                column = np.full(max_nodes + 1, -np.inf, dtype=np.float32)
                column[2:] = np.float32(1.0) + weighted[1:max_nodes]
                values[:, level, 1] = column
                continue
            with np.errstate(invalid="ignore"):
                candidates = values[split, level, branches - 1] + weighted[remainder_index]
            candidates = np.where(valid_split & ~np.isnan(candidates), candidates, -np.inf).astype(np.float32)
            choice = candidates.argmax(axis=1)
            best = candidates[node_count, choice]
            values[:, level, branches] = best
            best_split[:, level, branches] = np.where(np.isfinite(best), choice, -1)
        best_over_branches[:, level] = values[:, level, :].max(axis=1)
    values.setflags(write=False)
    best_split.setflags(write=False)
    return SequoiaTable(values=values, best_split=best_split, levels=levels)


@dataclass(frozen=True)
class SequoiaPlan:
    """The optimal topology for (budget, depth): ``parents`` breadth-first with root -1, ``ranks`` the 0-based
    sibling rank of each node (-1 for the root), and the DP's float32 value of F(T)."""

    parents: tuple[int, ...]
    ranks: tuple[int, ...]
    expected_accept_length: float


def sequoia_plan(profile: AcceptanceProfile, budget: int, depth: int, max_branch: int | None = None) -> SequoiaPlan:
    """Optimal tree with exactly ``budget`` draft nodes and at most ``depth`` draft levels."""
    table = sequoia_table(profile, budget + 1, depth + 1, max_branch=max_branch)
    value = table.best_value(budget + 1)
    if not np.isfinite(value):
        branch = profile.max_rank if max_branch is None else min(max_branch, profile.max_rank)
        raise SpecError(
            f"no tree with {budget} draft nodes fits depth {depth} with at most {branch} children per node; "
            f"lower the budget or raise the depth"
        )
    parents = table.parents(budget + 1)
    ranks = [-1]
    sibling_count = [0] * len(parents)
    for parent in parents[1:]:
        ranks.append(sibling_count[parent])
        sibling_count[parent] += 1
    return SequoiaPlan(parents=tuple(parents), ranks=tuple(ranks), expected_accept_length=value)
