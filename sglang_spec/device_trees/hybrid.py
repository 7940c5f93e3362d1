"""``hybrid`` trees for a batch of requests grown on the device: the trees ``tree/best_first.BestFirstBuilder`` grows
for the ``hybrid`` policy (the head's top-k and the context's copies under one budget), node for node and in its
node order, from a device token history, with no host read: fixed shapes and a fixed number of rounds. The head's
forwards come from a callback (``HeadExpand``), given each round's nodes as a padded tensor, so a server runs one
batched head forward per round without learning on the host which nodes they are.

Why fixed rounds reproduce the host builder. The builder (1) takes the root's head candidates, (2) grows with the
lookup until its selection (the ``budget`` nodes of highest reach, ties to the lower id, at most ``width``
children a node) stops changing, expanding every selected node not yet looked up, and then, once a head level,
(3) expands with the head the selected nodes of that level (at most ``width``, best first, if the level pays for
its forward under ``costs``) and grows with the lookup again. Its node ids are creation order; a candidate that a
node's other source already proposed is no new node but re-rates the existing one ("both").

* The lookup growth after (1) or (3) ends within ``depth`` passes. A node's candidates are merged into existing
  children only when the node was expanded by the other source first: the head expands selected nodes, and a
  selection that the lookup growth left stable has every node looked up, so after (1) a merge happens only when
  the lookup expands the root, in the first pass. From the second pass on, nothing is re-rated, so nodes only
  join, a node once left out of a selection stays out, and the nodes a pass expands are all children of the
  previous pass's: one depth deeper each pass, below the depth limit. Passes past the end are no-ops here (the
  selection has every node looked up), so ``depth`` passes per growth give the host's trees.
* A pass expands, in the host's order (the root, then the selection best first), the nodes not yet looked up, each
  into at most ``lookup_width`` slots; a head round expands at most ``width`` (or ``budget``) nodes into ``topk``
  slots each. New node ids are numbered in slot order, skipping candidates that merge: the host's ids.
* Selection is a stable sort of -reach; the width bound is computed without a loop over nodes: a node is kept when
  its parent is kept and fewer than ``width`` of its siblings precede it in the order (a parent always precedes
  its children: reach never grows down a path).
* A request whose head stops (no node of the level, or the level priced out) stays stopped, as the host's loop
  breaks; its later passes and head rounds change nothing (its slots are masked).

Reaches are float64 products along the path, as the host computes them (bit-equal). The pricing's sums
(``costs``) are left to right as the host's on a CPU; on a GPU, a scan may round them in another order, which can
only change a decision that is a float64 tie.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from sglang_spec.device_trees.lookup import (NgramMatch, best_order, compact_nodes, lookup_estimates, select_best,
                                             write_paths)
from sglang_spec.kernels.ngram_match import ngram_match_reference
from sglang_spec.costs import CostCurve, step_seconds
from sglang_spec.tree.proposal import DraftTree
from sglang_spec.tree.best_first import head_rounds, node_cell, node_source, outcome_cells
from sglang_spec.tree.profile import LOOKUP_RANKS, MTP_BINS, MTP_DEPTHS, SourceCounts
from sglang_spec.tree.token_tree import TokenTree


@dataclass(frozen=True)
class SourceEstimates:
    """``SourceCounts``' estimates (accepted / offered, float64) as device tables.

    lookup:   [max_ngram, LOOKUP_RANKS], by match length (row n - 1) and rank.
    mtp:      [MTP_DEPTHS, MTP_BINS], by depth (last row: deeper) and draft-probability bin.
    both:     [max_ngram], by the lookup's match length.
    mtp_top1: [MTP_DEPTHS], the head's rank-0 candidate by depth (what a level not run yet is expected to add).
    """

    lookup: torch.Tensor
    mtp: torch.Tensor
    both: torch.Tensor
    mtp_top1: torch.Tensor

    @classmethod
    def of(cls, counts: SourceCounts, device: torch.device | str) -> SourceEstimates:
        def table(cells: list) -> torch.Tensor:
            return torch.tensor(cells, dtype=torch.float64, device=device)
        estimate = counts.estimate
        return cls(lookup=lookup_estimates(counts, device),
                   mtp=table([[estimate(cell) for cell in row] for row in counts.mtp]),
                   both=table([estimate(cell) for cell in counts.both]),
                   mtp_top1=table([estimate(cell) for cell in counts.mtp_top1]))


def step_prices(costs: CostCurve, max_nodes: int, max_forwards: int, device: torch.device | str) -> torch.Tensor:
    """[max_nodes + 1, max_forwards + 1] float64: ``step_seconds(costs, nodes, forwards)`` (row 0 unused)."""
    return torch.tensor([[step_seconds(costs, max(nodes, 1), forwards) for forwards in range(max_forwards + 1)]
                         for nodes in range(max_nodes + 1)], dtype=torch.float64, device=device)


@dataclass(frozen=True)
class HybridGrowth:
    """What a head callback reads of the growing trees: [R, C] per node (C = ``node_capacity``, plus one spare
    column that no node uses), the root in column 0.

    tokens:  int64 node tokens; -1 past the nodes made.
    parents: int64 parent column; -1 for the root and past the nodes.
    depths:  int64 depth (0: root).
    paths:   [R, C, depth] int64, the tokens from below the root down to the node; -1 past its depth.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    paths: torch.Tensor


# (level, nodes [R, W] int64 with -1 padding, growth) -> (tokens [R, W, topk] int64, probs [R, W, topk] float32):
# the head's candidates for each node, best first (anything in padded rows; they are ignored)
HeadExpand = Callable[[int, torch.Tensor, HybridGrowth], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class HybridTrees:
    """One tree a request, nodes in the host builder's order (root first, parents before children), padded to
    ``budget + 1`` columns.

    tokens:        [R, budget + 1] int64; -1 past ``num_nodes``.
    parents:       [R, budget + 1] int64 parent column; -1 for the root and past ``num_nodes``.
    match_lengths: [R, budget + 1] int64, the lookup's match length (0: not a lookup proposal, the root, padding).
    lookup_ranks:  [R, budget + 1] int64, its rank among the lookup's candidates (0 where no lookup proposal).
    mtp_probs:     [R, budget + 1] float64, the head's draft probability (-1: not a head proposal, root, padding).
    mtp_ranks:     [R, budget + 1] int64, its rank among the head's candidates (-1 likewise).
    estimates:     [R, budget + 1] float64, the node's estimate (1 at the root, 0 padding).
    reach:         [R, budget + 1] float64, product of the estimates along its path (1 at the root, 0 padding).
    num_nodes:     [R] int64, 1 + the draft nodes kept.
    mtp_forwards:  [R] int64, head rounds run for the request (the root's candidates not counted).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    match_lengths: torch.Tensor
    lookup_ranks: torch.Tensor
    mtp_probs: torch.Tensor
    mtp_ranks: torch.Tensor
    estimates: torch.Tensor
    reach: torch.Tensor
    num_nodes: torch.Tensor
    mtp_forwards: torch.Tensor


@dataclass(frozen=True)
class HybridShape:
    """The policy's bounds (``TreePolicy`` of shape ``hybrid``): ``width`` None = unbounded; ``topk`` = its
    ``effective_topk``."""

    budget: int
    depth: int
    width: int | None
    topk: int
    mtp_levels: int
    lookup_width: int
    max_ngram: int

    @property
    def head_rounds(self) -> int:
        """Head levels that can run: a level's nodes must lie above the depth limit."""
        return head_rounds(self.mtp_levels, self.depth)

    @property
    def round_width(self) -> int:
        """Nodes one head round expands at most."""
        return self.budget if self.width is None else min(self.width, self.budget)

    def node_capacity(self) -> int:
        """Nodes the growth can make: the root's head candidates, ``depth`` lookup passes of at most budget + 1
        nodes after each head round (and before the first), and the head rounds' candidates."""
        passes = (self.head_rounds + 1) * self.depth
        return 1 + self.topk + passes * (self.budget + 1) * self.lookup_width + \
            self.head_rounds * self.round_width * self.topk


def build_hybrid_trees(history: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, root_tokens: torch.Tensor,
                       root_probs: torch.Tensor, head: HeadExpand, estimates: SourceEstimates, shape: HybridShape,
                       prices: torch.Tensor | None = None, match: NgramMatch = ngram_match_reference) -> HybridTrees:
    """The ``hybrid`` tree below each request's last history token (its root).

    history [H, L] int64 and lengths [H] (``kernels/ngram_match``'s layout); rows [R], each request's history row;
    root_tokens [R, topk] int64 / root_probs [R, topk] float32: the head's candidates for the root (best first,
    what the previous step's commit drafted); ``head`` expands a round's nodes; ``prices`` from ``step_prices``
    (at least ``budget + 1 + round_width`` nodes and ``head_rounds + 2`` forwards) when the policy has costs,
    else None. ``match``: the n-gram kernel on a GPU, its reference on a CPU."""
    growth = _Growth(history, lengths, rows, estimates, shape, match)
    growth.add_head_children(torch.zeros_like(rows)[:, None], torch.ones_like(rows, dtype=torch.bool)[:, None],
                             root_tokens[:, None, :], root_probs[:, None, :])
    selected = growth.grow_lookup()
    active = torch.ones_like(rows, dtype=torch.bool)
    for level in range(shape.head_rounds):
        todo = growth.head_todo(selected, level, active)
        has_todo = (todo >= 0).any(1)
        if prices is not None:
            active = active & has_todo & growth.level_pays(selected, todo, prices)
        else:
            active = active & has_todo
        todo = torch.where(active[:, None], todo, torch.full_like(todo, -1))
        tokens, probs = head(level, todo, growth.view())
        growth.mtp_forwards += active.long()
        growth.add_head_children(todo.clamp(min=0), todo >= 0, tokens, probs)
        selected = growth.grow_lookup()
    if prices is not None:
        selected = growth.best_prefix(selected, prices)
    return growth.result(selected)


class _Growth:
    """The node tables of every request's growing tree (``HybridGrowth``'s fields plus the sources' fields), and
    the host builder's steps on them."""

    def __init__(self, history: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor,
                 estimates: SourceEstimates, shape: HybridShape, match: NgramMatch) -> None:
        device = history.device
        self.history, self.lengths, self.rows = history, lengths, rows
        self.estimates, self.shape, self.match = estimates, shape, match
        requests = rows.shape[0]
        self.capacity = shape.node_capacity()
        columns = self.capacity + 1  # a spare last column takes the writes of candidates not made

        def full(value: float, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.full((requests, columns), value, dtype=dtype, device=device)

        self.tokens, self.parents, self.depths = full(-1), full(-1), full(0)
        self.match_lengths, self.lookup_ranks = full(0), full(0)
        self.mtp_probs, self.mtp_ranks = full(-1.0, torch.float64), full(-1)
        self.lookup_done, self.mtp_done = full(False, torch.bool), full(False, torch.bool)
        self.node_estimates, self.reach = full(0.0, torch.float64), full(0.0, torch.float64)
        self.paths = torch.full((requests, columns, max(shape.depth, 1)), -1, dtype=torch.int64, device=device)
        self.tokens[:, 0] = history[rows, (lengths[rows] - 1).clamp(min=0)]
        self.node_estimates[:, 0] = 1.0
        self.reach[:, 0] = 1.0
        self.count = torch.ones(requests, dtype=torch.int64, device=device)
        self.mtp_forwards = torch.zeros(requests, dtype=torch.int64, device=device)
        self.node_ids = torch.arange(columns, device=device)
        self.batch = torch.arange(requests, device=device)

    def view(self) -> HybridGrowth:
        return HybridGrowth(tokens=self.tokens, parents=self.parents, depths=self.depths, paths=self.paths)

    def _exists(self) -> torch.Tensor:
        return self.node_ids[None, :] < self.count[:, None]

    # candidates -------------------------------------------------------------------------------------------------
    def _add(self, parents: torch.Tensor, expanding: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Candidates ``tokens`` [R, S, K] (-1: none) of the nodes ``parents`` [R, S] where ``expanding``: new
        nodes for tokens their parent has no child with, numbered in slot order after the nodes so far; returns
        [R, S * K] the column each candidate's fields go to (its new or existing node; the spare column when
        none)."""
        requests, slots, width = tokens.shape
        made = (expanding[:, :, None] & (tokens >= 0)).reshape(requests, -1)
        flat_parents = parents[:, :, None].expand(requests, slots, width).reshape(requests, -1)
        flat_tokens = tokens.reshape(requests, -1)
        same = (self.parents[:, None, :] == flat_parents[:, :, None]) & \
            (self.tokens[:, None, :] == flat_tokens[:, :, None]) & self._exists()[:, None, :]
        existing = (same.long() * self.node_ids).sum(-1)  # at most one child of a parent has a given token
        merged = made & same.any(-1)
        new = made & ~merged
        new_ids = self.count[:, None] + new.long().cumsum(1) - 1
        spare = torch.full_like(new_ids, self.capacity)
        target = torch.where(new, new_ids, spare)
        depths = torch.gather(self.depths, 1, flat_parents) + 1
        self.tokens.scatter_(1, target, flat_tokens)
        self.parents.scatter_(1, target, flat_parents)
        self.depths.scatter_(1, target, depths)
        write_paths(self.paths, flat_parents, flat_tokens, depths, target)
        self.count = self.count + new.long().sum(1)
        return torch.where(new, new_ids, torch.where(merged, existing, spare))

    def add_lookup_children(self, nodes: torch.Tensor, expanding: torch.Tensor) -> None:
        """Looks ``nodes`` [R, S] up where ``expanding`` (the host's ``_lookup_expand``, in slot order)."""
        requests, slots = nodes.shape
        shape = self.shape
        query_rows = self.rows[:, None].expand(requests, slots).reshape(-1)
        tails = self.paths[self.batch[:, None], nodes].reshape(requests * slots, -1)
        tail_lengths = torch.where(expanding, torch.gather(self.depths, 1, nodes), 0).reshape(-1)
        found = self.match(self.history, self.lengths, query_rows, tails, tail_lengths, max_ngram=shape.max_ngram,
                           width=shape.lookup_width)
        tokens = found.tokens.view(requests, slots, shape.lookup_width)
        target = self._add(nodes, expanding, tokens)
        matches = found.match_lengths.view(requests, slots, 1).expand(requests, slots, shape.lookup_width)
        ranks = torch.arange(shape.lookup_width, device=nodes.device).expand(requests, slots, shape.lookup_width)
        self.match_lengths.scatter_(1, target, matches.reshape(requests, -1))
        self.lookup_ranks.scatter_(1, target, ranks.reshape(requests, -1))
        self.lookup_done.scatter_(1, torch.where(expanding, nodes, self.capacity), True)
        self._rate()

    def add_head_children(self, nodes: torch.Tensor, expanding: torch.Tensor, tokens: torch.Tensor,
                          probs: torch.Tensor) -> None:
        """The head's candidates ``tokens`` / ``probs`` [R, S, topk] of ``nodes`` [R, S] where ``expanding``
        (the host's ``_mtp_expand``)."""
        requests, slots, topk = tokens.shape
        target = self._add(nodes, expanding, tokens)
        ranks = torch.arange(topk, device=nodes.device).expand(requests, slots, topk)
        self.mtp_probs.scatter_(1, target, probs.to(torch.float64).reshape(requests, -1))
        self.mtp_ranks.scatter_(1, target, ranks.reshape(requests, -1))
        self.mtp_done.scatter_(1, torch.where(expanding, nodes, self.capacity), True)
        self._rate()

    def _rate(self) -> None:
        """Every node's estimate from its fields (the host's ``_rate``, which runs whenever a field changes), and
        the reaches."""
        tables, shape = self.estimates, self.shape
        lookup_row = self.match_lengths.clamp(1, shape.max_ngram) - 1
        bins = torch.floor(self.mtp_probs * MTP_BINS).long().clamp(0, MTP_BINS - 1)
        depth_row = self.depths.clamp(1, MTP_DEPTHS) - 1
        from_lookup = self.match_lengths > 0
        from_head = self.mtp_probs >= 0
        rated = torch.where(from_lookup & from_head, tables.both[lookup_row],
                            torch.where(from_lookup,
                                        tables.lookup[lookup_row, self.lookup_ranks.clamp(max=LOOKUP_RANKS - 1)],
                                        tables.mtp[depth_row, bins]))
        exists = self._exists()
        self.node_estimates = torch.where(exists, rated, torch.zeros_like(rated))
        self.node_estimates[:, 0] = 1.0
        reach = torch.zeros_like(self.node_estimates)
        reach[:, 0] = 1.0
        parents = self.parents.clamp(min=0)
        for depth in range(1, self.shape.depth + 1):
            reach = torch.where(exists & (self.depths == depth), torch.gather(reach, 1, parents) * self.node_estimates,
                                reach)
        self.reach = reach

    # selection --------------------------------------------------------------------------------------------------
    def best(self) -> torch.Tensor:
        """[R, budget]: the host's ``_best(budget)``, best first, -1 where fewer."""
        budget, width = self.shape.budget, self.shape.width
        if width is None:
            return select_best(self.reach, self.node_ids, self.count, budget)
        order, exists = best_order(self.reach, self.node_ids, self.count)
        chosen = torch.gather(self._kept_within_width(order, exists, width) & exists, 1, order)
        place = chosen.long().cumsum(1)
        take = chosen & (place <= budget)
        selected = torch.full((order.shape[0], budget + 1), -1, dtype=torch.int64, device=order.device)
        selected.scatter_(1, torch.where(take, place - 1, budget), order)
        return selected[:, :budget]

    def _kept_within_width(self, order: torch.Tensor, exists: torch.Tensor, width: int) -> torch.Tensor:
        """Nodes the width bound lets through: the parent kept and fewer than ``width`` siblings before the node in
        ``order`` (a node skipped takes its descendants with it, as the host's loop skips them)."""
        columns = order.shape[1]
        place = torch.empty_like(order)
        place.scatter_(1, order, self.node_ids.expand_as(order))
        family = torch.where(exists, self.parents.clamp(min=0) * columns + place,
                             torch.full_like(place, columns * columns))
        by_family = torch.sort(family, dim=1, stable=True).indices
        parents_sorted = torch.gather(self.parents, 1, by_family)
        starts = torch.ones_like(parents_sorted, dtype=torch.bool)
        starts[:, 1:] = parents_sorted[:, 1:] != parents_sorted[:, :-1]
        index = self.node_ids.expand_as(order)
        first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
        sibling_place = torch.empty_like(order)
        sibling_place.scatter_(1, by_family, index - first)
        kept = torch.zeros_like(exists)
        kept[:, 0] = True
        parents = self.parents.clamp(min=0)
        for depth in range(1, self.shape.depth + 1):
            here = exists & (self.depths == depth)
            kept = torch.where(here, torch.gather(kept, 1, parents) & (sibling_place < width), kept)
        return kept

    def grow_lookup(self) -> torch.Tensor:
        """The host's ``_grow_lookup(budget)``: ``depth`` passes (module doc), then the selection."""
        depth_limit = self.shape.depth
        for _ in range(depth_limit):
            selected = self.best()
            nodes = torch.cat([torch.zeros_like(selected[:, :1]), selected.clamp(min=0)], dim=1)
            listed = torch.cat([torch.ones_like(selected[:, :1], dtype=torch.bool), selected >= 0], dim=1)
            expanding = listed & ~torch.gather(self.lookup_done, 1, nodes) & \
                (torch.gather(self.depths, 1, nodes) < depth_limit)
            self.add_lookup_children(nodes, expanding)
        return self.best()

    def head_todo(self, selected: torch.Tensor, level: int, active: torch.Tensor) -> torch.Tensor:
        """[R, round_width]: the selected nodes a head round at ``level`` expands (-1 padding), best first."""
        nodes = selected.clamp(min=0)
        parent_done = torch.gather(self.mtp_done, 1, torch.gather(self.parents, 1, nodes).clamp(min=0))
        eligible = (selected >= 0) & active[:, None] & ~torch.gather(self.mtp_done, 1, nodes) & \
            (torch.gather(self.depths, 1, nodes) == level + 1) & parent_done
        if level + 1 >= self.shape.depth:
            eligible = torch.zeros_like(eligible)
        width = self.shape.round_width
        place = eligible.long().cumsum(1)
        take = eligible & (place <= width)
        todo = torch.full((selected.shape[0], width + 1), -1, dtype=torch.int64, device=selected.device)
        todo.scatter_(1, torch.where(take, place - 1, width), selected)
        return todo[:, :width]

    # pricing ----------------------------------------------------------------------------------------------------
    def _reach_of(self, nodes: torch.Tensor) -> torch.Tensor:
        """[R, S] the reach of ``nodes`` [R, S], 0 where -1 (padding)."""
        return torch.where(nodes >= 0, torch.gather(self.reach, 1, nodes.clamp(min=0)),
                           torch.zeros_like(self.reach[:, :1]))

    def level_pays(self, selected: torch.Tensor, todo: torch.Tensor, prices: torch.Tensor) -> torch.Tensor:
        """[R] bool, the host's ``_level_pays``: one more head level lowers the predicted time per token."""
        listed = selected >= 0
        reach = self._reach_of(selected)
        accept = 1.0 + reach.cumsum(1)[:, -1]  # the host's sum, left to right
        forwards = self.mtp_forwards + 1
        nodes = listed.long().sum(1) + 1
        now = prices[nodes, forwards] / accept
        todo_nodes = todo.clamp(min=0)
        is_child = (self.parents[:, None, :] == todo_nodes[:, :, None]) & self._exists()[:, None, :] & \
            (todo >= 0)[:, :, None]
        estimates = self.node_estimates[:, None, :]
        covered = torch.where(is_child, estimates, torch.zeros_like(estimates))
        covered = covered.cumsum(2)[:, :, -1]  # children in id order: the host's insertion order
        top1 = self.estimates.mtp_top1[(torch.gather(self.depths, 1, todo_nodes) + 1).clamp(max=MTP_DEPTHS) - 1]
        room = torch.minimum(top1, (1.0 - covered).clamp(min=0.0))
        gains = torch.where(todo >= 0, torch.gather(self.reach, 1, todo_nodes) * room, torch.zeros_like(room))
        gain = gains.cumsum(1)[:, -1]
        after = prices[nodes + (todo >= 0).long().sum(1), forwards + 1] / (accept + gain)
        return after < now

    def best_prefix(self, selected: torch.Tensor, prices: torch.Tensor) -> torch.Tensor:
        """``selected`` cut to the host's ``_best_prefix``: the count with the least predicted time per token."""
        listed = selected >= 0
        reach = self._reach_of(selected)
        ones = torch.ones_like(reach[:, :1])
        accept = torch.cat([ones, reach], dim=1).cumsum(1)  # 1, then the host's running sum
        forwards = (self.mtp_forwards + 1)[:, None]
        counts = torch.arange(selected.shape[1] + 1, device=selected.device)[None, :]
        times = prices[(counts + 1).expand_as(accept), forwards.expand_as(accept)] / accept
        valid = torch.cat([ones.bool(), listed], dim=1)
        best = torch.where(valid, times, torch.full_like(times, float("inf"))).argmin(1)  # the first least
        return torch.where(counts[:, 1:] <= best[:, None], selected, torch.full_like(selected, -1))

    # result -----------------------------------------------------------------------------------------------------
    def result(self, selected: torch.Tensor) -> HybridTrees:
        columns = self.capacity
        keep = torch.zeros_like(self.lookup_done)
        keep.scatter_(1, torch.where(selected >= 0, selected, columns), True)
        keep[:, 0] = True
        nodes = slice(0, columns)  # the spare column dropped
        fields, num_nodes = compact_nodes(keep[:, nodes], self.parents[:, nodes], self.shape.budget + 1, {
            "tokens": (self.tokens[:, nodes], -1), "match_lengths": (self.match_lengths[:, nodes], 0),
            "lookup_ranks": (self.lookup_ranks[:, nodes], 0), "mtp_probs": (self.mtp_probs[:, nodes], -1.0),
            "mtp_ranks": (self.mtp_ranks[:, nodes], -1), "estimates": (self.node_estimates[:, nodes], 0.0),
            "reach": (self.reach[:, nodes], 0.0)})
        return HybridTrees(num_nodes=num_nodes, mtp_forwards=self.mtp_forwards, **fields)


def hybrid_draft_trees(trees: HybridTrees, counts: SourceCounts, rows: list[bool] | None = None
                       ) -> list[DraftTree | None]:
    """The host's ``DraftTree`` of each request (what ``TreeDrafter.observe`` learns from), read from ``trees``:
    the tree, each node's sources, the cells its outcome counts in (``tree/best_first``'s ``node_cell`` and
    ``outcome_cells``, as ``BestFirstBuilder`` gives them) and the estimates it was grown with. ``rows``:
    the requests to read (None: all); the others are None."""
    names = ("tokens", "parents", "match_lengths", "lookup_ranks", "mtp_probs", "mtp_ranks", "estimates", "reach")
    host = {name: getattr(trees, name).tolist() for name in names}
    result: list[DraftTree | None] = []
    for row, (count, forwards) in enumerate(zip(trees.num_nodes.tolist(), trees.mtp_forwards.tolist())):
        if rows is not None and not rows[row]:
            result.append(None)
            continue
        tree = TokenTree.from_parents(host["parents"][row][:count], tokens=host["tokens"][row][:count])
        depths = tree.depths.tolist()
        sources: list[int] = [0]
        cells: list[tuple[list[float], ...]] = [()]
        for node in range(1, count):
            match, prob = host["match_lengths"][row][node], host["mtp_probs"][row][node]
            cell = node_cell(counts, depths[node], match, host["lookup_ranks"][row][node], prob)
            cells.append(outcome_cells(counts, cell, depths[node], host["mtp_ranks"][row][node]))
            sources.append(node_source(match, prob))
        result.append(DraftTree(tree=tree, sources=tuple(sources), cells=tuple(cells),
                                estimates=tuple(host["estimates"][row][:count]), mtp_forwards=forwards,
                                expected_accept_length=1.0 + math.fsum(host["reach"][row][1:count])))
    return result
