"""``lookup`` trees for a batch of requests grown on the device, from a device token history (the contexts) and
the lookup estimates of ``SourceCounts``: the trees ``tree/best_first.BestFirstBuilder`` grows for the ``lookup``
policy, node for node and in its node order, with no host read (fixed shapes and a fixed number of rounds, what a
CUDA graph would need; no graph captures it yet).

Why a fixed number of rounds reproduces the host builder. The builder repeats: select the ``budget`` non-root
nodes of highest reach (ties to the lower node id), expand with the lookup every selected node (and the root)
not yet expanded, above the depth limit, in selection order. Adding nodes never moves an existing node up the
order, so a node left out of one selection is left out of all later ones: every node is expanded in the round
after it was made or never. Round k therefore expands nodes of depth k - 1 only (at most ``budget``), the
builder's node ids are (round, place in the selection, candidate rank) in order, and ``depth`` rounds are all
there is. Each round here is: one selection (a stable sort of -reach over the nodes so far), one batched lookup
(``kernels/ngram_match``: each expanded node's query is its request's history plus the node's path), and the new
children appended in that order. Reaches are float64 products along the path, as the host computes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from sglang_spec.kernels.ngram_match import NgramMatches, ngram_match_reference
from sglang_spec.tree.proposal import DraftTree
from sglang_spec.tree.profile import SOURCE_LOOKUP, SourceCounts
from sglang_spec.tree.token_tree import TokenTree

NgramMatch = Callable[..., NgramMatches]  # kernels.ngram_match.ngram_match or its reference


@dataclass(frozen=True)
class LookupTrees:
    """One tree a request, its nodes in the host builder's order (root first, parents before children), padded to
    ``budget + 1`` columns.

    tokens:        [R, budget + 1] int64, node tokens (column 0 the root); -1 past ``num_nodes``.
    parents:       [R, budget + 1] int64, parent column; -1 for the root and past ``num_nodes``.
    match_lengths: [R, budget + 1] int64, the lookup match length the node was proposed at (0: root, padding).
    ranks:         [R, budget + 1] int64, its rank among its parent's candidates (-1: root, padding).
    reach:         [R, budget + 1] float64, product of the estimates along its path (1 at the root, 0 padding).
    num_nodes:     [R] int64, 1 + the draft nodes kept (at most ``budget + 1``).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    match_lengths: torch.Tensor
    ranks: torch.Tensor
    reach: torch.Tensor
    num_nodes: torch.Tensor


def lookup_estimates(counts: SourceCounts, device: torch.device | str) -> torch.Tensor:
    """[max_ngram, LOOKUP_RANKS] float64: estimate of a lookup candidate by match length (row n - 1) and rank."""
    return torch.tensor([[counts.estimate(cell) for cell in row] for row in counts.lookup], dtype=torch.float64,
                        device=device)


def node_capacity(budget: int, depth: int, lookup_width: int) -> int:
    """Nodes the growth can make: the root's candidates, then at most ``budget`` nodes expanded a round."""
    return 1 + lookup_width + max(depth - 1, 0) * budget * lookup_width


def build_lookup_trees(history: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, estimates: torch.Tensor,
                       budget: int, depth: int, lookup_width: int, match: NgramMatch = ngram_match_reference
                       ) -> LookupTrees:
    """The ``lookup`` tree below each request's last history token (its root).

    history [H, L] int64 and lengths [H] (``kernels/ngram_match``'s layout; a row ends with the request's root);
    rows [R] int64, each request's history row; estimates from ``lookup_estimates``. ``budget``, ``depth`` and
    ``lookup_width`` are the policy's (``TreePolicy``); a width bound the builder applies is never reached here as
    long as it is at least ``lookup_width``, which the caller checks. ``match``: the kernel on a GPU, its
    reference on a CPU."""
    device = history.device
    requests = rows.shape[0]
    capacity = node_capacity(budget, depth, lookup_width)
    max_ngram = estimates.shape[0]
    ranks_calibrated = estimates.shape[1]
    batch = torch.arange(requests, device=device)
    # per node, with a spare last column that takes the writes of candidates not made (no node ever has its id)
    tokens = torch.full((requests, capacity + 1), -1, dtype=torch.int64, device=device)
    parents = torch.full_like(tokens, -1)
    match_lengths = torch.zeros_like(tokens)
    ranks = torch.full_like(tokens, -1)
    depths = torch.zeros_like(tokens)
    reach = torch.zeros(requests, capacity + 1, dtype=torch.float64, device=device)
    paths = torch.full((requests, capacity + 1, max(depth, 1)), -1, dtype=torch.int64, device=device)
    tokens[:, 0] = history[rows, (lengths[rows] - 1).clamp(min=0)]
    reach[:, 0] = 1.0
    count = torch.ones(requests, dtype=torch.int64, device=device)
    node_ids = torch.arange(capacity + 1, device=device)

    for level in range(depth):
        # the selection, and its nodes of this round's depth (the root in the first round): what gets expanded
        if level == 0:
            expand = torch.zeros(requests, 1, dtype=torch.int64, device=device)
            expanding = torch.ones(requests, 1, dtype=torch.bool, device=device)
        else:
            expand = select_best(reach, node_ids, count, budget)
            expanding = (expand >= 0) & (torch.gather(depths, 1, expand.clamp(min=0)) == level)
        slots = expand.shape[1]
        query_nodes = expand.clamp(min=0)
        query_rows = rows[:, None].expand(requests, slots).reshape(-1)
        tails = paths[batch[:, None], query_nodes].reshape(requests * slots, -1)
        tail_lengths = torch.where(expanding, torch.gather(depths, 1, query_nodes), 0).reshape(-1)
        found = match(history, lengths, query_rows, tails, tail_lengths, max_ngram=max_ngram, width=lookup_width)
        # new children in (selection place, rank) order, numbered after the nodes so far
        child_tokens = found.tokens.view(requests, slots, lookup_width)
        made = expanding[:, :, None] & (child_tokens >= 0)
        flat_made = made.reshape(requests, -1)
        child_ids = count[:, None] + flat_made.long().cumsum(1) - 1
        target = torch.where(flat_made, child_ids, torch.full_like(child_ids, capacity))  # unmade -> spare column
        child_parents = query_nodes[:, :, None].expand(requests, slots, lookup_width).reshape(requests, -1)
        child_matches = found.match_lengths.view(requests, slots, 1).expand(requests, slots, lookup_width)
        child_ranks = torch.arange(lookup_width, device=device).expand(requests, slots, lookup_width)
        child_estimates = estimates[(child_matches.clamp(1, max_ngram) - 1),
                                    child_ranks.clamp(max=ranks_calibrated - 1)].reshape(requests, -1)
        child_reach = torch.gather(reach, 1, child_parents) * child_estimates
        child_depths = torch.gather(depths, 1, child_parents) + 1
        tokens.scatter_(1, target, child_tokens.reshape(requests, -1))
        parents.scatter_(1, target, child_parents)
        match_lengths.scatter_(1, target, child_matches.reshape(requests, -1))
        ranks.scatter_(1, target, child_ranks.reshape(requests, -1))
        depths.scatter_(1, target, child_depths)
        reach.scatter_(1, target, child_reach)
        write_paths(paths, child_parents, child_tokens.reshape(requests, -1), child_depths, target)
        count = count + flat_made.long().sum(1)

    chosen = select_best(reach, node_ids, count, budget)
    keep = torch.zeros(requests, capacity + 1, dtype=torch.bool, device=device)
    keep.scatter_(1, torch.where(chosen >= 0, chosen, capacity), True)
    keep[:, 0] = True
    nodes = slice(0, capacity)  # the spare column dropped
    return _compact(keep[:, nodes], tokens[:, nodes], parents[:, nodes], match_lengths[:, nodes], ranks[:, nodes],
                    reach[:, nodes], budget)


def write_paths(paths: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor,
                target: torch.Tensor) -> None:
    """New nodes' paths into ``paths`` [R, C, D] (tokens below the root, -1 padded) at columns ``target`` [R, N]:
    each its parent's (``parents`` [R, N]) with its own token (``tokens``) at its depth (``depths``). With D = 1
    (trees of depth 1, whose nodes are never looked up) nothing is written."""
    width = paths.shape[2]
    if width == 1:
        return
    batch = torch.arange(paths.shape[0], device=paths.device)
    parent_paths = paths[batch[:, None], parents]  # [R, N, D]
    position = (depths - 1).clamp(max=width - 1)
    own = torch.arange(width, device=paths.device)[None, None, :] == position[:, :, None]
    paths.scatter_(1, target[:, :, None].expand(-1, -1, width), torch.where(own, tokens[:, :, None], parent_paths))


def best_order(reach: torch.Tensor, node_ids: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The nodes [R, C] by reach, highest first, ties to the lower id (a stable sort), the root and the nodes past
    ``count`` last; and [R, C] which non-root nodes exist."""
    exists = (node_ids[None, :] < count[:, None]) & (node_ids[None, :] > 0)
    key = torch.where(exists, -reach, torch.full_like(reach, float("inf")))
    return torch.sort(key, dim=1, stable=True).indices, exists


def select_best(reach: torch.Tensor, node_ids: torch.Tensor, count: torch.Tensor, budget: int) -> torch.Tensor:
    """[R, budget] the non-root nodes of highest reach (``best_order``), -1 where fewer."""
    order, exists = best_order(reach, node_ids, count)
    order = order[:, :budget]
    return torch.where(torch.gather(exists, 1, order), order, torch.full_like(order, -1))


def _compact(keep: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, match_lengths: torch.Tensor,
             ranks: torch.Tensor, reach: torch.Tensor, budget: int) -> LookupTrees:
    fields, num_nodes = compact_nodes(keep, parents, budget + 1, {
        "tokens": (tokens, -1), "match_lengths": (match_lengths, 0), "ranks": (ranks, -1), "reach": (reach, 0.0)})
    return LookupTrees(num_nodes=num_nodes, **fields)


def compact_nodes(keep: torch.Tensor, parents: torch.Tensor, columns: int,
                  fields: dict[str, tuple[torch.Tensor, float | int]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The kept nodes (``keep`` [R, C], a parent-closed set with the root) in id order, padded to ``columns``:
    each of ``fields`` (name -> ([R, C] values, fill past the kept nodes)) and ``parents`` renumbered (-1 for the
    root and padding); and [R] the nodes kept."""
    requests = keep.shape[0]
    new_index = keep.long().cumsum(1) - 1  # [R, C] column of each kept node
    target = torch.where(keep, new_index, torch.full_like(new_index, columns))
    renumbered = torch.where(parents >= 0, torch.gather(new_index, 1, parents.clamp(min=0)),
                             torch.full_like(parents, -1))

    def gathered(values: torch.Tensor, fill: float | int) -> torch.Tensor:
        out = torch.full((requests, columns + 1), fill, dtype=values.dtype, device=values.device)
        out.scatter_(1, target, values)
        return out[:, :columns]

    result = {name: gathered(values, fill) for name, (values, fill) in fields.items()}
    result["parents"] = gathered(renumbered, -1)
    return result, keep.long().sum(1)


def lookup_draft_trees(trees: LookupTrees, counts: SourceCounts) -> list[DraftTree]:
    """The host's ``DraftTree`` of each request (what ``TreeDrafter.observe`` learns from), read from ``trees``:
    the tree, and per node the lookup cell its outcome counts in."""
    result = []
    host = {name: getattr(trees, name).tolist() for name in ("tokens", "parents", "match_lengths", "ranks", "reach")}
    for row, count in enumerate(trees.num_nodes.tolist()):
        matches, ranks, reach = host["match_lengths"][row], host["ranks"][row], host["reach"][row]
        cells = [counts.lookup_cell(matches[node], ranks[node]) for node in range(1, count)]
        result.append(DraftTree(
            tree=TokenTree.from_parents(host["parents"][row][:count], tokens=host["tokens"][row][:count]),
            sources=(0,) + (SOURCE_LOOKUP,) * (count - 1),
            cells=((),) + tuple((cell,) for cell in cells),
            estimates=(1.0,) + tuple(counts.estimate(cell) for cell in cells),
            mtp_forwards=0,
            expected_accept_length=1.0 + math.fsum(reach[1:count]),
        ))
    return result
