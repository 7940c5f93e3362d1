"""Hybrid token trees: the MTP head's top-k and the context's n-gram continuations as branches of one tree, under
one budget.

Two candidate sources propose children of a tree node:

* **lookup** (``tree/ngram.py``): the tokens that followed the longest n-gram ending the node's context (prompt +
  generated tokens + the node's path) earlier in that context. Free: no model runs.
* **mtp**: the MTP head's top-k for the node (``CandidateSource``, exact ancestry). The root's come free with the
  previous step's commit; every deeper level costs one head forward.

A token proposed by both is one node ("both"). To put both sources in one budget every candidate gets an estimated
conditional acceptance, P(it is the accepted child | its parent was accepted), from ``SourceCalibration``: a table
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

Policies: ``lookup`` (lookup candidates only; the head never runs) and ``hybrid`` (both). With a cost curve
(``adaptive``, what ``--auto`` runs) the budget is chosen per step by ``tree/cost_model.step_seconds``: the tree
prefix (the b best nodes, b = 0 meaning a plain step) with the least predicted time per token, and an MTP level
is run only when its predicted gain pays for its forward.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from sglang_spec.errors import SpecError, brief
from sglang_spec.files import read_json
from sglang_spec.tree.candidates import CandidateSource, GrowingTree
from sglang_spec.tree.cost_model import CostCurve, step_seconds
from sglang_spec.tree.ngram import DEFAULT_MAX_NGRAM, NgramIndex
from sglang_spec.tree.policies import MAX_TOPK
from sglang_spec.tree.token_tree import MAX_BUDGET, MAX_DEPTH, TokenTree

HYBRID_POLICY_NAMES = ("lookup", "hybrid")
SOURCE_MTP = 1
SOURCE_LOOKUP = 2
SOURCE_BOTH = SOURCE_MTP | SOURCE_LOOKUP
SOURCE_NAMES = {0: "target", SOURCE_MTP: "mtp", SOURCE_LOOKUP: "lookup", SOURCE_BOTH: "both"}

LOOKUP_RANKS = 4  # distinct lookup continuations calibrated (and proposed) per node at most
MTP_DEPTHS = 3  # head acceptance rows: depth 1, 2, and 3 or deeper
MTP_BINS = 10  # draft-probability bins of width 0.1
DEFAULT_CALIBRATION = "lookup-generic.json"


def _mtp_bin(prob: float) -> int:
    return min(max(int(prob * MTP_BINS), 0), MTP_BINS - 1)


@dataclass
class SourceCalibration:
    """Acceptance estimates per source, as (accepted, offered) counts per cell; an estimate is their ratio.

    lookup[n - 1][rank]: a lookup candidate whose n-gram match has length n (1..max_ngram) and rank ``rank``.
    mtp[d - 1][bin]:     a head candidate at depth d (the last row for deeper ones) with draft probability in
                         [bin / 10, (bin + 1) / 10).
    both[n - 1]:         a token both sources proposed, the lookup's match length n.
    mtp_top1[d - 1]:     the head's rank-0 candidate at depth d (last row: deeper), whatever its probability: what
                         a head level not yet run is expected to add.
    ``prior_weight`` caps the counts a loaded prior keeps, so what a decoder observes online can move it.
    """

    lookup: list[list[list[float]]]
    mtp: list[list[list[float]]]
    both: list[list[float]]
    mtp_top1: list[list[float]]
    source: str = "generic prior"
    prior_weight: float = 20.0

    @property
    def max_ngram(self) -> int:
        return len(self.lookup)

    @classmethod
    def generic(cls, max_ngram: int = DEFAULT_MAX_NGRAM, weight: float = 4.0) -> SourceCalibration:
        """A weak prior for models without a shipped calibration: lookup acceptance rising with the match length
        (n / (n + 2) for the best continuation, a third of that for the others), the head taken at its word
        (acceptance = draft probability), agreement as the two combined like independent evidence."""
        lookup = []
        for n in range(1, max_ngram + 1):
            best = n / (n + 2)
            lookup.append([[weight * (best if rank == 0 else best / 3), weight] for rank in range(LOOKUP_RANKS)])
        mtp = [[[weight * (b + 0.5) / MTP_BINS, weight] for b in range(MTP_BINS)] for _ in range(MTP_DEPTHS)]
        both = []
        for n in range(1, max_ngram + 1):
            estimate = 1 - (1 - n / (n + 2)) * (1 - 0.5)
            both.append([weight * estimate, weight])
        top1 = [[weight * 0.5, weight] for _ in range(MTP_DEPTHS)]
        return cls(lookup, mtp, both, top1, source="generic prior", prior_weight=weight)

    @classmethod
    def from_obj(cls, obj: Any, source: str = "calibration", prior_weight: float = 20.0) -> SourceCalibration:
        try:
            lookup, mtp, both, top1 = obj["lookup"], obj["mtp"], obj["both"], obj["mtp_top1"]
            calibration = cls(
                lookup=[[[float(a), float(t)] for a, t in row] for row in lookup],
                mtp=[[[float(a), float(t)] for a, t in row] for row in mtp],
                both=[[float(a), float(t)] for a, t in both],
                mtp_top1=[[float(a), float(t)] for a, t in top1],
                source=source,
                prior_weight=prior_weight,
            )
        except (KeyError, TypeError, ValueError, OverflowError) as error:
            raise SpecError(f"{source}: not a source calibration ({brief(error, 80)})") from None
        calibration._check(source)
        calibration._cap(prior_weight)
        return calibration

    def _check(self, source: str) -> None:
        shape = f"expected lookup [n][{LOOKUP_RANKS}], mtp [{MTP_DEPTHS}][{MTP_BINS}], both [n], mtp_top1 [{MTP_DEPTHS}]"
        if (not self.lookup or len(self.mtp) != MTP_DEPTHS or len(self.both) != len(self.lookup)
                or len(self.mtp_top1) != MTP_DEPTHS):
            raise SpecError(f"{source}: {shape}")
        cells = self._cells()
        if any(len(row) != LOOKUP_RANKS for row in self.lookup) or any(len(row) != MTP_BINS for row in self.mtp):
            raise SpecError(f"{source}: {shape}")
        for accepted, offered in cells:
            if not (math.isfinite(accepted) and math.isfinite(offered)) or accepted < 0 or offered <= 0 or accepted > offered:
                raise SpecError(f"{source}: a cell has counts ({accepted}, {offered}); need 0 <= accepted <= offered, offered > 0")

    def _cap(self, weight: float) -> None:
        for cell in self._cells():
            if cell[1] > weight:
                cell[0] *= weight / cell[1]
                cell[1] = weight

    def _cells(self) -> list[list[float]]:
        return [cell for row in self.lookup for cell in row] + [c for row in self.mtp for c in row] + self.both + self.mtp_top1

    @classmethod
    def load(cls, path: str | Path | None, max_ngram: int = DEFAULT_MAX_NGRAM) -> SourceCalibration:
        """A calibration file, or the shipped generic one (fitted on the project's training traffic)."""
        if path is None:
            resource = resources.files("sglang_spec.data").joinpath("profiles", DEFAULT_CALIBRATION)
            if not resource.is_file():
                return cls.generic(max_ngram)
            return cls.from_obj(json.loads(resource.read_text()), f"built-in {DEFAULT_CALIBRATION}")
        path = Path(path)
        return cls.from_obj(read_json(path, "calibration"), str(path))

    def to_obj(self) -> dict[str, Any]:
        return {"lookup": self.lookup, "mtp": self.mtp, "both": self.both, "mtp_top1": self.mtp_top1}

    def copy(self) -> SourceCalibration:
        return SourceCalibration.from_obj(self.to_obj(), self.source, prior_weight=math.inf)

    # estimates ----------------------------------------------------------------------------------------------
    def lookup_cell(self, match_length: int, rank: int) -> list[float]:
        return self.lookup[min(match_length, self.max_ngram) - 1][min(rank, LOOKUP_RANKS - 1)]

    def mtp_cell(self, depth: int, prob: float) -> list[float]:
        return self.mtp[min(depth, MTP_DEPTHS) - 1][_mtp_bin(prob)]

    def both_cell(self, match_length: int) -> list[float]:
        return self.both[min(match_length, self.max_ngram) - 1]

    def mtp_top1_cell(self, depth: int) -> list[float]:
        return self.mtp_top1[min(depth, MTP_DEPTHS) - 1]

    @staticmethod
    def estimate(cell: list[float]) -> float:
        return cell[0] / cell[1]

    @staticmethod
    def observe(cell: list[float], accepted: bool) -> None:
        """One offered candidate of this cell, accepted or not (online calibration)."""
        cell[0] += 1.0 if accepted else 0.0
        cell[1] += 1.0


@dataclass(frozen=True)
class HybridPolicy:
    """A validated hybrid (or lookup-only) tree configuration.

    name:         "lookup" (context candidates only) or "hybrid" (context + MTP head).
    budget:       most draft nodes per step, root excluded.
    depth:        most draft tokens on one path (a copied run can be this long).
    mtp_levels:   hybrid: most head forwards expanding tree levels below the root's children (0 = the root's
                  children only, which come free with the previous commit).
    topk:         head candidates per expanded node.
    lookup_width: distinct lookup continuations per node (1..4).
    max_ngram:    longest n-gram the context index matches.
    costs:        a measured cost curve: choose the budget per step (0 = plain step) and run head levels only
                  when they pay (``--auto``); None = always ``budget`` nodes and ``mtp_levels`` levels.
    calibration:  acceptance estimates (prior); None = the shipped generic one.
    """

    name: str
    budget: int
    depth: int
    mtp_levels: int = 2
    topk: int = 4
    lookup_width: int = 2
    max_ngram: int = DEFAULT_MAX_NGRAM
    costs: CostCurve | None = None
    calibration: SourceCalibration | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.name not in HYBRID_POLICY_NAMES:
            raise SpecError(f"unknown hybrid policy {self.name!r}; choose one of {', '.join(HYBRID_POLICY_NAMES)}")
        if not isinstance(self.budget, int) or not 1 <= self.budget <= MAX_BUDGET:
            raise SpecError(f"budget must be in 1..{MAX_BUDGET} (draft nodes, root excluded), got {self.budget}")
        if not isinstance(self.depth, int) or not 1 <= self.depth <= MAX_DEPTH:
            raise SpecError(f"depth must be in 1..{MAX_DEPTH}, got {self.depth}")
        if not isinstance(self.mtp_levels, int) or self.mtp_levels < 0:
            raise SpecError(f"mtp_levels must be >= 0, got {self.mtp_levels}")
        if not isinstance(self.topk, int) or not 1 <= self.topk <= MAX_TOPK:
            raise SpecError(f"topk must be in 1..{MAX_TOPK}, got {self.topk}")
        if not isinstance(self.lookup_width, int) or not 1 <= self.lookup_width <= LOOKUP_RANKS:
            raise SpecError(f"lookup_width must be in 1..{LOOKUP_RANKS}, got {self.lookup_width}")
        if not isinstance(self.max_ngram, int) or not 1 <= self.max_ngram <= 32:
            raise SpecError(f"max_ngram must be in 1..32, got {self.max_ngram}")

    @property
    def uses_mtp(self) -> bool:
        return self.name == "hybrid"

    def prior(self) -> SourceCalibration:
        """The calibration a decoder starts from (its own copy; it learns online from there)."""
        calibration = self.calibration if self.calibration is not None else SourceCalibration.load(None, self.max_ngram)
        if calibration.max_ngram != self.max_ngram:
            raise SpecError(f"the calibration covers matches up to {calibration.max_ngram} tokens, the policy "
                            f"matches up to {self.max_ngram}; use max_ngram {calibration.max_ngram}")
        return calibration.copy()

    def build(
        self, root_token: int, context: NgramIndex, mtp: CandidateSource | None, calibration: SourceCalibration
    ) -> HybridTree:
        """The tree below ``root_token``; ``context`` holds every verified token up to and including the root."""
        return _HybridBuilder(self, root_token, context, mtp if self.uses_mtp else None, calibration).build()


@dataclass(frozen=True, eq=False)
class HybridTree:
    """A built tree and, per node (the tree's numbering): its source (SOURCE_* flags, 0 for the root), the
    calibration cells its outcome is counted in (the one it was estimated from first; none for the root), and its
    estimated conditional acceptance.
    ``mtp_forwards``: head forwards spent building it (the root's children are free). ``expected_accept_length``:
    1 + the sum of the nodes' reach estimates."""

    tree: TokenTree
    sources: tuple[int, ...]
    cells: tuple[tuple[list[float], ...], ...]
    estimates: tuple[float, ...]
    mtp_forwards: int
    expected_accept_length: float


class _HybridBuilder:
    """Best-first growth over both sources (module doc). Nodes live in a GrowingTree (the head's exact-ancestry
    drafting reads its parents and tokens); per-node side lists hold what the sources said."""

    def __init__(self, policy: HybridPolicy, root_token: int, context: NgramIndex, mtp: CandidateSource | None,
                 calibration: SourceCalibration) -> None:
        self.policy = policy
        self.context = context
        self.mtp = mtp
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
        calibration = self.calibration
        if self.match[node] and self.mtp_prob[node] >= 0:
            cell = calibration.both_cell(self.match[node])
        elif self.match[node]:
            cell = calibration.lookup_cell(self.match[node], self.lookup_rank[node])
        else:
            cell = calibration.mtp_cell(self.tree.depths[node], self.mtp_prob[node])
        self.cell[node] = cell
        self.estimate[node] = calibration.estimate(cell)

    def _lookup_expand(self, node: int) -> None:
        self.lookup_done.add(node)
        for candidate in self.context.continuations(self.tails[node], self.policy.lookup_width):
            child = self._child(node, candidate.token)
            self.match[child], self.lookup_rank[child] = candidate.match_length, candidate.rank
            self._rate(child)

    def _mtp_expand(self, nodes: list[int]) -> None:
        assert self.mtp is not None
        candidates = self.mtp.expand(self.tree, nodes, self.policy.topk)
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
        """The ``count`` non-root nodes with the highest reach (ties to the lower id, so parents come first)."""
        reach = self._reach()
        order = sorted(range(1, len(reach)), key=lambda node: (-reach[node], node))
        return order[:count]

    def _grow_lookup(self, count: int) -> list[int]:
        """Expands every selected node with the (free) lookup until the selection stops changing."""
        depth_limit = self.policy.depth
        while True:
            selected = self._best(count)
            todo = [node for node in [0, *selected] if node not in self.lookup_done and self.tree.depths[node] < depth_limit]
            if not todo:
                return selected
            for node in todo:
                self._lookup_expand(node)

    def build(self) -> HybridTree:
        policy = self.policy
        costs = policy.costs
        if self.mtp is not None:
            self._mtp_expand([0])  # the root's head candidates come with the previous commit
        selected = self._grow_lookup(policy.budget)
        levels = 0
        while self.mtp is not None and levels < policy.mtp_levels:
            todo = [node for node in selected if node not in self.mtp_done and self.tree.depths[node] < policy.depth
                    and self.tree.parents[node] in self.mtp_done]
            if not todo or (costs is not None and not self._level_pays(selected, todo, costs)):
                break
            self._mtp_expand(todo)
            levels += 1
            selected = self._grow_lookup(policy.budget)
        reach = self._reach()
        if costs is not None:
            selected = selected[: self._best_prefix([reach[node] for node in selected], costs)]
        return self._result(selected, reach)

    def _head_forwards(self) -> int:
        """Head forwards this step charges: the levels run, plus the commit forward that drafts the next root's
        children (whenever the head is in use)."""
        return 0 if self.mtp is None else self.mtp_forwards + 1

    def _best_prefix(self, reach: list[float], costs: CostCurve) -> int:
        """How many of the selected nodes (best first) give the least predicted time per token; 0 = a plain
        step. Time per token = step_seconds / F, F = 1 + the kept nodes' reach (``tree/cost_model.py``)."""
        forwards = self._head_forwards()
        best_count, best_time = 0, step_seconds(costs, 1, forwards)
        accept = 1.0
        for count, value in enumerate(reach, start=1):
            accept += value
            time_per_token = step_seconds(costs, count + 1, forwards) / accept
            if time_per_token < best_time:
                best_count, best_time = count, time_per_token
        return best_count

    def _level_pays(self, selected: list[int], todo: list[int], costs: CostCurve) -> bool:
        """Whether one more head level is predicted to lower the time per token: its new children are guessed
        at each expanded node's reach times the calibrated depth acceptance of a top-1 head candidate."""
        reach = self._reach()
        accept = 1.0 + sum(reach[node] for node in selected)
        forwards = self._head_forwards()
        nodes = len(selected) + 1
        now = step_seconds(costs, nodes, forwards) / accept
        calibration = self.calibration
        gain = sum(reach[node] * calibration.estimate(calibration.mtp_top1_cell(self.tree.depths[node] + 1))
                   for node in todo)
        after = step_seconds(costs, nodes + len(todo), forwards + 1) / (accept + gain)
        return after < now

    def _cells(self, node: int) -> tuple[list[float], ...]:
        cell = self.cell[node]
        if cell is None:
            return ()
        if self.mtp_rank[node] == 0:
            return (cell, self.calibration.mtp_top1_cell(self.tree.depths[node]))
        return (cell,)

    def _result(self, selected: Sequence[int], reach: list[float]) -> HybridTree:
        ids = sorted({0, *selected})
        subtree = self.tree.subtree(ids)
        sources = tuple(
            0 if node == 0 else (SOURCE_LOOKUP if self.match[node] else 0) | (SOURCE_MTP if self.mtp_prob[node] >= 0 else 0)
            for node in ids
        )
        return HybridTree(
            tree=subtree,
            sources=sources,
            cells=tuple(self._cells(node) for node in ids),
            estimates=tuple(self.estimate[node] for node in ids),
            mtp_forwards=self.mtp_forwards,
            expected_accept_length=1.0 + math.fsum(reach[node] for node in ids if node != 0),
        )
