"""The tree policies: one configuration type for every tree shape. Each grows a tree from its candidate sources
(``tree/draft.DraftSources``) under ``budget`` draft nodes and ``depth`` draft levels and returns a ``DraftTree``.

Shapes over the MTP head's per-node top-k (one candidate-source call per expansion round):

* ``chain``    recursive MTP, one candidate per depth (SGLang NEXTN with topk=1); min(budget, depth) nodes.
* ``eagle``    EAGLE-2 beams: the root's top-k, then per depth the best k of the k*k expansions by cumulative
               draft probability; keep the best ``budget`` of all candidate slots (SGLang's
               ``select_top_k_tokens`` + ``organize_draft_results``).
* ``sequoia``  the DP-optimal static topology for an acceptance profile, instantiated with the top-b ranks at
               each node.
* ``specexec`` best-first: the ``budget`` nodes with the highest cumulative draft probability. Grown level by
               level: a level's nodes that are among the best ``budget`` so far are expanded (at most ``width``
               of them, the best first), since a node outside that set can only have children below it.

Shapes over the context too (``tree/best_first.py``), best-first by calibrated per-source acceptance:

* ``lookup``   the context's n-gram continuations only; the head never runs.
* ``hybrid``   the context's continuations and the head's top-k in one tree; head levels below the root's
               children up to ``mtp_levels``, and with a cost curve only where they pay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from sglang_spec.errors import SpecError
from sglang_spec.tree.candidates import CandidateSource, GrowingTree
from sglang_spec.costs import CostCurve
from sglang_spec.tree.proposal import DraftSources, DraftTree
from sglang_spec.tree.best_first import BestFirstShape, build_best_first
from sglang_spec.tree.ngram import DEFAULT_MAX_NGRAM
from sglang_spec.tree.profile import LOOKUP_RANKS, AcceptanceProfile, SourceCounts
from sglang_spec.tree.sequoia import sequoia_plan
from sglang_spec.tree.token_tree import MAX_BUDGET, MAX_DEPTH, TokenTree

HEAD_POLICY_NAMES = ("chain", "eagle", "sequoia", "specexec")
CONTEXT_POLICY_NAMES = ("lookup", "hybrid")
HEAD_FREE_POLICY_NAMES = ("lookup",)  # trees that never ask the MTP head
POLICY_NAMES = HEAD_POLICY_NAMES + CONTEXT_POLICY_NAMES
DEFAULT_TOPK = {"chain": 1, "eagle": 4, "sequoia": 8, "specexec": 8, "lookup": 4, "hybrid": 4}
MAX_TOPK = 64  # candidates per node: more is hours of drafting for nodes no profile ever accepts
MAX_NGRAM = 32  # longest context match: past it every match is a copy of a copy


@dataclass(frozen=True)
class TreePolicy:
    """A validated tree-building configuration.

    name:    one of POLICY_NAMES.
    budget:  draft nodes, root excluded (1..1023).
    depth:   most draft tokens on one root-to-leaf path (1..64).
    topk:    candidates requested per expanded node: EAGLE's beam width, SpecExec's and Sequoia's maximum number
             of children per node, the head's candidates per node of a hybrid tree (1..MAX_TOPK); None = the
             policy default (DEFAULT_TOPK). Ignored by chain and lookup.
    profile: acceptance profile; required by sequoia. lookup / hybrid start from its ``sources`` counts (a
             generic prior without it).
    width:   a static bound, as inside SGLang's draft loop. specexec: the most nodes expanded on one level;
             lookup / hybrid: the most children a node keeps and the most nodes one head round expands. None = no
             bound (exact SpecExec, unbounded best-first).
    mtp_levels:   hybrid: most head forwards expanding tree levels below the root's children (0 = the root's
                  children only, which come free with the previous commit).
    lookup_width: lookup / hybrid: distinct context continuations per node (1..4).
    max_ngram:    lookup / hybrid: longest n-gram the context index matches.
    costs:        lookup / hybrid: a measured cost curve; each step keeps the prefix of its best-first tree with
                  the least predicted time per token (0 nodes = a plain step) and runs a head level only when it
                  pays (what ``--auto`` sets). None = always ``budget`` nodes and ``mtp_levels`` levels.
    """

    name: str
    budget: int
    depth: int
    topk: int | None = None
    profile: AcceptanceProfile | None = None
    width: int | None = None
    mtp_levels: int = 2
    lookup_width: int = 2
    max_ngram: int = DEFAULT_MAX_NGRAM
    costs: CostCurve | None = None

    def __post_init__(self) -> None:
        if self.name not in POLICY_NAMES:
            raise SpecError(f"unknown tree policy {self.name!r}; choose one of {', '.join(POLICY_NAMES)}")
        if not isinstance(self.budget, int) or self.budget < 1:
            raise SpecError(f"budget must be >= 1 (draft nodes, root excluded), got {self.budget}")
        if self.budget > MAX_BUDGET:
            raise SpecError(f"budget {self.budget} exceeds the maximum {MAX_BUDGET} (1024 tree tokens per request)")
        if not isinstance(self.depth, int) or self.depth < 1:
            raise SpecError(f"depth must be >= 1 (draft tokens on the longest path), got {self.depth}")
        if self.depth > MAX_DEPTH:
            raise SpecError(f"depth {self.depth} exceeds the maximum depth {MAX_DEPTH}")
        if self.topk is not None and (not isinstance(self.topk, int) or self.topk < 1):
            raise SpecError(f"topk must be >= 1, got {self.topk}")
        if self.topk is not None and self.topk > MAX_TOPK:
            raise SpecError(f"topk {self.topk} exceeds the maximum {MAX_TOPK} candidates per node")
        if self.width is not None and (self.name not in ("specexec",) + CONTEXT_POLICY_NAMES
                                       or not isinstance(self.width, int) or self.width < 1):
            raise SpecError(f"width bounds specexec, lookup and hybrid trees and must be >= 1, got {self.width} "
                            f"for {self.name}")
        if self.name == "sequoia" and self.profile is None:
            raise SpecError("the sequoia policy needs an acceptance profile (--acceptance PROFILE.json)")
        if not isinstance(self.mtp_levels, int) or self.mtp_levels < 0:
            raise SpecError(f"mtp_levels must be >= 0, got {self.mtp_levels}")
        if not isinstance(self.lookup_width, int) or not 1 <= self.lookup_width <= LOOKUP_RANKS:
            raise SpecError(f"lookup_width must be in 1..{LOOKUP_RANKS}, got {self.lookup_width}")
        if not isinstance(self.max_ngram, int) or not 1 <= self.max_ngram <= MAX_NGRAM:
            raise SpecError(f"max_ngram must be in 1..{MAX_NGRAM}, got {self.max_ngram}")
        if self.costs is not None and not self.uses_context:
            raise SpecError(f"a per-step cost curve sizes best-first trees over the context; {self.name} is sized "
                            "once (choose_auto)")
        if self.name == "eagle":
            slots = self.effective_topk + (self.depth - 1) * self.effective_topk**2
            if self.budget > slots:
                raise SpecError(
                    f"eagle with topk {self.effective_topk} and depth {self.depth} has only {slots} candidate "
                    f"slots (topk + (depth-1)*topk^2) for budget {self.budget}; "
                    "raise topk or depth, or lower the budget"
                )

    @property
    def effective_topk(self) -> int:
        return DEFAULT_TOPK[self.name] if self.topk is None or self.name == "chain" else self.topk

    @property
    def uses_head(self) -> bool:
        """Whether trees draw candidates from the MTP head (every shape but lookup)."""
        return self.name not in HEAD_FREE_POLICY_NAMES

    @property
    def uses_context(self) -> bool:
        """Whether trees draw candidates from the request's context (lookup, hybrid)."""
        return self.name in CONTEXT_POLICY_NAMES

    def best_first_shape(self) -> BestFirstShape:
        """lookup / hybrid: what the best-first builder may grow."""
        return BestFirstShape(budget=self.budget, depth=self.depth, topk=self.effective_topk, width=self.width,
                              lookup_width=self.lookup_width, mtp_levels=self.mtp_levels, uses_head=self.uses_head,
                              costs=self.costs)

    def source_counts(self) -> SourceCounts:
        """The per-source counts a drafter starts from (its own copy, learnt further online): the profile's for
        best-first shapes, a generic prior otherwise (head-only shapes rank by the positional table)."""
        if not self.uses_context or self.profile is None:
            return SourceCounts.generic(self.max_ngram)
        return self.profile.source_counts(self.max_ngram)

    def static_shape(self) -> TokenTree | None:
        """The topology every tree of this policy has whatever the candidates (ranks = child order), or None
        where the candidates decide it. Sequoia's DP tree; a chain."""
        if self.name == "sequoia":
            assert self.profile is not None
            plan = sequoia_plan(self.profile, self.budget, self.depth, max_branch=self.topk)
            return TokenTree.from_parents(list(plan.parents), ranks=list(plan.ranks))
        if self.name == "chain":
            length = min(self.budget, self.depth)
            return TokenTree.from_parents(list(range(-1, length)), ranks=[-1] + [0] * length)
        return None

    def build(self, root_token: int, sources: DraftSources, counts: SourceCounts | None = None) -> DraftTree:
        """This policy's tree below ``root_token`` from ``sources``; ``counts`` rank the candidates of best-first
        shapes (default: a fresh ``source_counts()``; head-only shapes rank by the positional table)."""
        if self.uses_context:
            if sources.context is None:
                raise SpecError(f"the {self.name} policy looks the context up; give DraftSources a context index")
            return build_best_first(self.best_first_shape(), root_token, sources,
                                    self.source_counts() if counts is None else counts)
        if sources.mtp is None:
            raise SpecError(f"the {self.name} policy drafts with an MTP head; give one (or use --policy lookup)")
        return DraftTree.from_head(_BUILDERS[self.name](self, GrowingTree(root_token), sources.mtp))


def _build_chain(policy: TreePolicy, tree: GrowingTree, source: CandidateSource) -> TokenTree:
    node = 0
    for _ in range(min(policy.budget, policy.depth)):
        candidates = source.expand(tree, [node], 1)
        node = tree.add_children(node, candidates, 0, 1)[0]
    return tree.subtree()


def _best(tree: GrowingTree, node_ids: Sequence[int], count: int) -> list[int]:
    """The ``count`` nodes with the highest cumulative draft probability, best first. Ties go to the earlier
    node, i.e. the lower SGLang slot; a parent always precedes its children, so a selection stays connected."""
    order = sorted(range(len(node_ids)), key=lambda position: (-tree.path_probs[node_ids[position]], position))
    return [node_ids[position] for position in order[:count]]


def _build_eagle(policy: TreePolicy, tree: GrowingTree, source: CandidateSource) -> TokenTree:
    topk = policy.effective_topk
    candidates = source.expand(tree, [0], topk)
    # SGLang's candidate slots, level-major; the frontier is kept in score order, which fixes the slot order of
    # the next level's expansions (beam-major, then child rank).
    slots = tree.add_children(0, candidates, 0, topk)
    frontier = list(slots)
    for _ in range(1, policy.depth):
        candidates = source.expand(tree, frontier, topk)
        expansions = [
            child for row, beam in enumerate(frontier) for child in tree.add_children(beam, candidates, row, topk)
        ]
        slots.extend(expansions)
        frontier = _best(tree, expansions, topk)
    return tree.subtree(_best(tree, slots, policy.budget))


def _build_sequoia(policy: TreePolicy, tree: GrowingTree, source: CandidateSource) -> TokenTree:
    shape = policy.static_shape()
    assert shape is not None
    plan_parents = shape.parents.tolist()
    child_counts = [0] * len(plan_parents)
    for parent in plan_parents[1:]:
        child_counts[parent] += 1
    # The plan is breadth-first with each node's children consecutive, so adding children level by level in
    # node order reproduces the plan's numbering in the growing tree.
    level = [0]
    while level:
        parents = [node for node in level if child_counts[node] > 0]
        if not parents:
            break
        candidates = source.expand(tree, parents, max(child_counts[node] for node in parents))
        level = [
            child
            for row, node in enumerate(parents)
            for child in tree.add_children(node, candidates, row, child_counts[node])
        ]
    result = tree.subtree()
    assert result.parents.tolist() == plan_parents
    return result


def _build_specexec(policy: TreePolicy, tree: GrowingTree, source: CandidateSource) -> TokenTree:
    topk = policy.effective_topk
    level = [0]
    for depth in range(policy.depth):
        candidates = source.expand(tree, level, topk)
        children = [child for row, node in enumerate(level) for child in tree.add_children(node, candidates, row, topk)]
        if depth == policy.depth - 1:
            break
        selected = set(_best(tree, range(1, tree.num_nodes), policy.budget))
        level = _best(tree, [child for child in children if child in selected], policy.width or len(children))
        if not level:
            break
    return tree.subtree(_best(tree, range(1, tree.num_nodes), policy.budget))


_BUILDERS: dict[str, Callable[[TreePolicy, GrowingTree, CandidateSource], TokenTree]] = {
    "chain": _build_chain,
    "eagle": _build_eagle,
    "sequoia": _build_sequoia,
    "specexec": _build_specexec,
}
