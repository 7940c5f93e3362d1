"""Best-first trees over candidate sources (the ``lookup`` and ``hybrid`` shapes of ``TreePolicy``): the MTP
head's top-k and the context's n-gram continuations as branches of one tree, under one budget.

Two candidate sources propose children of a tree node:

* **lookup** (``tree/ngram.py``): the tokens that followed the longest n-gram ending the node's context (prompt +
  generated tokens + the node's path) earlier in that context. Free: no model runs.
* **mtp**: the MTP head's top-k for the node (``CandidateSource``, exact ancestry). The root's come free with the
  previous step's commit; every deeper level costs one head forward.

A token proposed by both is one node ("both"). To put both sources in one budget every candidate gets an estimated
conditional acceptance, P(it is the accepted child | its parent was accepted), from ``SourceCounts``: a table
per source, by match length and rank for lookup, by depth and draft probability for the head, by match length for
"both", each cell a Beta-style count (a prior, shipped or generic, plus what this decoder observed). A node's reach
(the product of estimates along its path, Sequoia's f(v)) never exceeds its parent's, so the ``budget`` nodes with
the highest reach form a connected tree (SpecExec's best-first, with calibrated estimates in place of raw draft
probabilities), and 1 + their sum is the expected accept length F(T).

Verification does not care where a node came from: greedy follows the target's argmax, and sampling uses
SpecExec's sample-and-match (draw y ~ p at the node, accept the child whose token is y). Every node here is a
deterministic proposal given the committed context (a lookup node's draft distribution is a point mass on its
token), and sample-and-match emits exact target samples for any such tree: lossless by construction
(``tests/decode/test_hybrid_sampling_law.py`` checks the joint law, and that treating a lookup node's confidence as
a draft probability in a ratio rule is caught).

Shapes: ``lookup`` (lookup candidates only; the head never runs) and ``hybrid`` (both). With the policy's
``width`` (a static bound, as SGLang's draft slots impose) a node keeps at most ``width`` children and a head
round expands at most ``width`` nodes (the best first).

The builder is driven round by round (``BestFirstBuilder.rounds``): it yields the nodes the head must expand and
receives their candidates, so a caller that grows many requests' trees at once (the SGLang plugin) runs one
batched head forward per round for all of them, and ``build_best_first`` is the same rounds driven by one
request's ``CandidateSource``. A round's nodes are all at one depth (the round's number): a node is expanded by
the head once selected with its parent expanded, and since candidates only ever join the selection's
competition, a node left out of one round's selection is never selected later. With a cost curve
(what ``--auto`` gives these shapes) the budget is chosen per step by the planner (``planner.plan_step``): the
tree prefix (the b best nodes, b = 0 meaning a plain step) with the least predicted time per token, and an MTP level
is run only when its predicted gain pays for its forward (a gain the context's copies leave room for: on a
copy-heavy step the head's deeper levels add little). A server passes each step's prices to the builder
(``costs``): there a head round's price depends on the batch it runs for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generator, Sequence

from sglang_spec.tree.candidates import Candidates, GrowingTree
from sglang_spec.costs import CostCurve, step_seconds
from sglang_spec.planner import plan_step
from sglang_spec.tree.proposal import DraftSources, DraftTree
from sglang_spec.tree.ngram import NgramIndex
from sglang_spec.tree.profile import SOURCE_LOOKUP, SOURCE_MTP, SourceCounts



@dataclass(frozen=True)
class BestFirstShape:
    """What a best-first tree may hold (``TreePolicy.best_first_shape`` for lookup and hybrid).

    budget:       draft nodes at most (root excluded).
    depth:        draft tokens on one path at most.
    topk:         the head's candidates kept at an expanded node.
    width:        nodes one head level expands at most (None: any).
    lookup_width: distinct context continuations per node.
    mtp_levels:   head levels below the root's children at most (0: the root's candidates only).
    uses_head:    whether the head proposes at all (False: lookup).
    costs:        a cost curve the step's size is chosen under (the planner), and a head level run only where it
                  pays; None: always ``budget`` nodes and ``mtp_levels`` levels.
    """

    budget: int
    depth: int
    topk: int
    width: int | None
    lookup_width: int
    mtp_levels: int
    uses_head: bool
    costs: CostCurve | None = None

    @property
    def head_rounds(self) -> int:
        """Head forwards one step's growth runs at most (``rounds``), beyond the root's candidates."""
        return head_rounds(self.mtp_levels, self.depth) if self.uses_head else 0


def head_rounds(mtp_levels: int, depth: int) -> int:
    """Head forwards a hybrid tree's growth runs at most: one a level below the root's children, ``mtp_levels`` of
    them, each expanding nodes above the depth limit (a level-l round expands nodes at depth l, and l < depth)."""
    return max(0, min(mtp_levels, depth - 1))


# one tree's growth: yields the nodes the head expands this round, is sent their Candidates, returns the tree
BestFirstRounds = Generator[list[int], Candidates, DraftTree]


def build_best_first(shape: BestFirstShape, root_token: int, sources: DraftSources, counts: SourceCounts) -> DraftTree:
    """The ``lookup`` / ``hybrid`` tree below ``root_token``; ``sources.context`` holds every verified token up to
    and including the root, ``sources.mtp`` the head (used by ``hybrid`` only)."""
    assert sources.context is not None, "best-first trees look the context up"
    builder = BestFirstBuilder(shape, root_token, sources.context, counts)
    rounds = builder.rounds()
    mtp = sources.mtp
    try:
        nodes = next(rounds)
        while True:
            assert mtp is not None, "hybrid trees expand nodes with the head"
            nodes = rounds.send(mtp.expand(builder.tree, nodes, shape.topk))
    except StopIteration as done:
        return done.value


def node_cell(calibration: SourceCounts, depth: int, match: int, lookup_rank: int, mtp_prob: float) -> list[float]:
    """The counts cell that rates a node: "both" by match length where both sources proposed it, else the lookup's
    by match length and rank, else the head's by depth and draft probability (``match`` 0: no lookup proposal;
    ``mtp_prob`` -1: no head proposal)."""
    if match and mtp_prob >= 0:
        return calibration.both_cell(match)
    if match:
        return calibration.lookup_cell(match, lookup_rank)
    return calibration.mtp_cell(depth, mtp_prob)


def outcome_cells(calibration: SourceCounts, cell: list[float], depth: int, mtp_rank: int) -> tuple[list[float], ...]:
    """The cells a node's outcome counts in: its own, and the depth's top-1 cell for the head's rank-0 candidate."""
    return (cell, calibration.mtp_top1_cell(depth)) if mtp_rank == 0 else (cell,)


def node_source(match: int, mtp_prob: float) -> int:
    """A draft node's source bits (``SOURCE_LOOKUP`` | ``SOURCE_MTP``)."""
    return (SOURCE_LOOKUP if match else 0) | (SOURCE_MTP if mtp_prob >= 0 else 0)


class BestFirstBuilder:
    """Best-first growth over both sources (module doc) for one request. Nodes live in a GrowingTree (the head's
    exact-ancestry drafting reads its parents, depths and tokens); per-node side lists hold what the sources
    said."""

    def __init__(self, shape: BestFirstShape, root_token: int, context: NgramIndex, calibration: SourceCounts,
                 costs: CostCurve | None = None) -> None:
        self.shape = shape
        # this step's prices (a server's depend on the batch it drafts for); None: the shape's own curve, if any
        self.costs = shape.costs if costs is None else costs
        self.context = context
        self.uses_head = shape.uses_head
        self.calibration = calibration
        self.tree = GrowingTree(root_token)
        self.tails: list[list[int]] = [[]]  # path tokens below the root
        self.children: list[dict[int, int]] = [{}]
        self.match: list[int] = [0]  # lookup match length (0: not a lookup proposal)
        self.lookup_rank: list[int] = [0]
        self.mtp_prob: list[float] = [-1.0]  # head draft probability (-1: not a head proposal)
        self.mtp_rank: list[int] = [-1]
        self.estimate: list[float] = [1.0]
        self.cell: list[list[float] | None] = [None]
        self.lookup_done: set[int] = set()
        self.mtp_done: set[int] = set()
        self.mtp_forwards = 0
        self.priced_out = False  # a head level was left out because its predicted gain did not pay (``costs``)

    # candidates ---------------------------------------------------------------------------------------------
    def _child(self, parent: int, token: int) -> int:
        node = self.children[parent].get(token)
        if node is None:
            node = self.tree.add(parent, token, len(self.children[parent]), 0.0)
            self.children[parent][token] = node
            self.children.append({})
            self.tails.append(self.tails[parent] + [token])
            self.match.append(0)
            self.lookup_rank.append(0)
            self.mtp_prob.append(-1.0)
            self.mtp_rank.append(-1)
            self.estimate.append(0.0)
            self.cell.append(None)
        return node

    def _rate(self, node: int) -> None:
        cell = node_cell(self.calibration, self.tree.depths[node], self.match[node], self.lookup_rank[node],
                         self.mtp_prob[node])
        self.cell[node] = cell
        self.estimate[node] = self.calibration.estimate(cell)

    def _lookup_expand(self, node: int) -> None:
        self.lookup_done.add(node)
        for candidate in self.context.continuations(self.tails[node], self.shape.lookup_width):
            child = self._child(node, candidate.token)
            self.match[child], self.lookup_rank[child] = candidate.match_length, candidate.rank
            self._rate(child)

    def _mtp_expand(self, nodes: list[int], candidates: Candidates) -> None:
        if any(node != 0 for node in nodes):
            self.mtp_forwards += 1
        tokens, probs = candidates.tokens.tolist(), candidates.probs.tolist()
        for row, node in enumerate(nodes):
            self.mtp_done.add(node)
            for rank, (token, prob) in enumerate(zip(tokens[row], probs[row])):
                child = self._child(node, token)
                self.mtp_prob[child], self.mtp_rank[child] = prob, rank
                self._rate(child)

    # selection ----------------------------------------------------------------------------------------------
    def _reach(self) -> list[float]:
        parents = self.tree.parents
        reach = [1.0] * len(parents)
        for node in range(1, len(parents)):
            reach[node] = reach[parents[node]] * self.estimate[node]
        return reach

    def _best(self, count: int) -> list[int]:
        """The ``count`` non-root nodes with the highest reach (ties to the lower id, so parents come first);
        with a width, a node whose parent already keeps ``width`` children is skipped, and so are its
        descendants."""
        reach = self._reach()
        order = sorted(range(1, len(reach)), key=lambda node: (-reach[node], node))
        width = self.shape.width
        if width is None:
            return order[:count]
        parents = self.tree.parents
        chosen: list[int] = []
        children = {0: 0}  # kept node -> its kept children
        for node in order:
            if len(chosen) == count:
                break
            parent = parents[node]
            if children.get(parent, width) >= width:
                continue
            children[parent] += 1
            children[node] = 0
            chosen.append(node)
        return chosen

    def _grow_lookup(self, count: int) -> list[int]:
        """Expands every selected node with the (free) lookup until the selection stops changing."""
        depth_limit = self.shape.depth
        while True:
            selected = self._best(count)
            todo = [node for node in [0, *selected]
                    if node not in self.lookup_done and self.tree.depths[node] < depth_limit]
            if not todo:
                return selected
            for node in todo:
                self._lookup_expand(node)

    def rounds(self) -> BestFirstRounds:
        """The growth (module doc): yields [0] (the root's head candidates, which come with the previous commit),
        then each head level's nodes (at most ``width``, best reach first); returns the tree."""
        shape = self.shape
        costs = self.costs
        if self.uses_head:
            self._mtp_expand([0], (yield [0]))
        selected = self._grow_lookup(shape.budget)
        levels = 0
        while self.uses_head and levels < shape.mtp_levels:
            # one depth a round (module doc); with a width, the nodes past it are never expanded by the head
            todo = [node for node in selected if node not in self.mtp_done and self.tree.depths[node] == levels + 1
                    and levels + 1 < shape.depth and self.tree.parents[node] in self.mtp_done]
            if shape.width is not None:
                todo = todo[: shape.width]  # ``selected`` is best first
            if not todo:
                break
            if costs is not None and not self._level_pays(selected, todo, costs):
                self.priced_out = True
                break
            self._mtp_expand(todo, (yield todo))
            levels += 1
            selected = self._grow_lookup(shape.budget)
        reach = self._reach()
        if costs is not None:
            selected = selected[: self._best_prefix([reach[node] for node in selected], costs)]
        return self._result(selected, reach)

    def _head_forwards(self) -> int:
        """Head forwards this step charges: the levels run, plus the commit forward that drafts the next root's
        children (whenever the head is in use)."""
        return self.mtp_forwards + 1 if self.uses_head else 0

    def _best_prefix(self, reach: list[float], costs: CostCurve) -> int:
        """How many of the selected nodes (best first) the step verifies: the planner's choice for this one request
        over every size, the step's head forwards charged to each (``planner.plan_step``); 0 = a plain step."""
        forwards = self._head_forwards()
        plan = plan_step([reach], lambda tokens: step_seconds(costs, tokens, forwards), range(1, len(reach) + 2))
        return plan.tokens - 1

    def _level_pays(self, selected: list[int], todo: list[int], costs: CostCurve) -> bool:
        """Whether one more head level is predicted to lower the time per token. What it adds below an expanded
        node is guessed at the node's reach times the calibrated depth acceptance of a top-1 head candidate, but
        no more than the acceptance its context children leave (a node's children are exclusive outcomes: where
        a long copy already holds 0.9 of it, the head can add 0.1 at most)."""
        reach = self._reach()
        accept = 1.0 + sum(reach[node] for node in selected)
        forwards = self._head_forwards()
        nodes = len(selected) + 1
        now = step_seconds(costs, nodes, forwards) / accept
        calibration = self.calibration
        gain = 0.0
        for node in todo:
            top1 = calibration.estimate(calibration.mtp_top1_cell(self.tree.depths[node] + 1))
            covered = sum(self.estimate[child] for child in self.children[node].values())
            gain += reach[node] * min(top1, max(0.0, 1.0 - covered))
        after = step_seconds(costs, nodes + len(todo), forwards + 1) / (accept + gain)
        return after < now

    def _cells(self, node: int) -> tuple[list[float], ...]:
        cell = self.cell[node]
        if cell is None:
            return ()
        return outcome_cells(self.calibration, cell, self.tree.depths[node], self.mtp_rank[node])

    def _result(self, selected: Sequence[int], reach: list[float]) -> DraftTree:
        ids = sorted({0, *selected})
        subtree = self.tree.subtree(ids)
        sources = tuple(0 if node == 0 else node_source(self.match[node], self.mtp_prob[node]) for node in ids)
        return DraftTree(
            tree=subtree,
            sources=sources,
            cells=tuple(self._cells(node) for node in ids),
            estimates=tuple(self.estimate[node] for node in ids),
            mtp_forwards=self.mtp_forwards,
            expected_accept_length=1.0 + math.fsum(reach[node] for node in ids if node != 0),
        )
