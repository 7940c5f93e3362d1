"""Acceptance profiles: how likely a drafted candidate is the accepted child of its (accepted) parent. The one
acceptance type of the project: every tree policy, the ``--auto`` chooser, the calibration command and the SGLang
plugin read it.

Two sections:
* ``rank_acceptance`` (Sequoia's positional table): P(the rank-k child of a depth-d node is the accepted one),
  for the MTP head's deterministic top-k children. The Sequoia DP and F(T) read it.
* ``sources`` (optional, ``SourceCounts``): per candidate source (context lookup by match length and rank, head
  by depth and draft probability, both by match length) the (accepted, offered) counts the best-first trees of
  the ``lookup`` / ``hybrid`` policies rank candidates by, and learn from online. Absent: a generic prior.

File format (JSON): ``{"rank_acceptance": [...], "sources": {...}, ...}`` where ``rank_acceptance`` is either one
list of floats (the same for every depth) or a list of lists (row d-1 for draft nodes at depth d; the last row
repeats for deeper nodes). Entry k is for the (k+1)-th ranked candidate. Other keys are kept as metadata.

``AcceptanceProfile.load(path)`` reads a file, or without one the built-in demo profile shipped in
``sglang_spec/data/profiles`` (Sequoia's published acceptance vector).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from sglang_spec.errors import SpecError, brief
from sglang_spec.files import finite_number, read_json, write_text_atomic
from sglang_spec.tree.ngram import DEFAULT_MAX_NGRAM
from sglang_spec.tree.token_tree import TokenTree

_SUM_TOLERANCE = 1e-5
DEFAULT_PROFILE = "sequoia_demo.json"

SOURCE_MTP = 1
SOURCE_LOOKUP = 2
SOURCE_BOTH = SOURCE_MTP | SOURCE_LOOKUP
SOURCE_NAMES = {0: "target", SOURCE_MTP: "mtp", SOURCE_LOOKUP: "lookup", SOURCE_BOTH: "both"}
LOOKUP_RANKS = 4  # distinct lookup continuations calibrated (and proposed) per node at most
MTP_DEPTHS = 3  # head acceptance rows: depth 1, 2, and 3 or deeper
MTP_BINS = 10  # draft-probability bins of width 0.1
PRIOR_WEIGHT = 20.0  # counts a loaded calibration keeps per cell, so what a decoder observes online can move it


@dataclass(frozen=True)
class AcceptanceProfile:
    """rank_acceptance[d][k]: probability that the k-th ranked (0-based) child of an accepted node at depth d is
    accepted (so the child sits at depth d + 1). Rows are padded with zeros to one width; the last row repeats
    for deeper nodes. Every row sums to at most 1 (the rest is "no child accepted"). ``source`` says where the
    profile came from (a path, or the built-in name), for reports. ``sources``: the per-source counts of
    best-first trees (None: not calibrated; ``source_counts`` then starts from a generic prior)."""

    rank_acceptance: tuple[tuple[float, ...], ...]
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)
    source: str = field(default="profile", compare=False)
    sources: SourceCounts | None = field(default=None, compare=False)

    @classmethod
    def from_obj(cls, obj: Any, source: str = "profile") -> AcceptanceProfile:
        if isinstance(obj, dict):
            if "rank_acceptance" not in obj:
                raise SpecError(f"{source}: missing key 'rank_acceptance' (a list of floats or a list of lists)")
            values = obj["rank_acceptance"]
            metadata = {key: value for key, value in obj.items() if key not in ("rank_acceptance", "sources")}
            counts = SourceCounts.from_obj(obj["sources"], f"{source}: sources") if "sources" in obj else None
        else:
            values, metadata, counts = obj, {}, None
        rows = _parse_rows(values, source)
        width = max(len(row) for row in rows)
        padded = tuple(tuple(row) + (0.0,) * (width - len(row)) for row in rows)
        return cls(rank_acceptance=padded, metadata=metadata, source=source, sources=counts)

    @classmethod
    def from_json(cls, path: str | Path) -> AcceptanceProfile:
        path = Path(path)
        return cls.from_obj(read_json(path, "acceptance profile"), source=str(path))

    @classmethod
    def load(cls, path: str | Path | None) -> AcceptanceProfile:
        """The profile in ``path``, or the built-in demo profile when ``path`` is None."""
        if path is not None:
            return cls.from_json(path)
        resource = resources.files("sglang_spec.data").joinpath("profiles", DEFAULT_PROFILE)
        return cls.from_obj(json.loads(resource.read_text()), f"built-in {DEFAULT_PROFILE}")

    @classmethod
    def uniform(cls, values: Sequence[float]) -> AcceptanceProfile:
        return cls.from_obj({"rank_acceptance": list(values)})

    @property
    def max_rank(self) -> int:
        """Number of ranks with a (possibly zero) acceptance entry; children beyond it are never accepted."""
        return len(self.rank_acceptance[0])

    @property
    def num_rows(self) -> int:
        return len(self.rank_acceptance)

    def row(self, child_depth: int) -> tuple[float, ...]:
        """Acceptance by rank for children at ``child_depth`` (>= 1)."""
        return self.rank_acceptance[min(child_depth, self.num_rows) - 1]

    def acceptance(self, child_depth: int, rank: int) -> float:
        row = self.row(child_depth)
        return row[rank] if 0 <= rank < len(row) else 0.0

    def matrix(self, max_depth: int) -> np.ndarray:
        """[max_depth, max_rank] float64; row d-1 for children at depth d."""
        return np.array([self.row(depth) for depth in range(1, max_depth + 1)], dtype=np.float64)

    def node_reach_probabilities(self, tree: TokenTree) -> list[float]:
        """f(v) = P(node v is on the accepted path) = product of rank acceptances along root -> v."""
        parents = tree.parents.tolist()
        depths = tree.depths.tolist()
        ranks = tree.ranks.tolist()
        reach = [1.0] * tree.num_nodes
        for node in range(1, tree.num_nodes):
            reach[node] = reach[parents[node]] * self.acceptance(depths[node], ranks[node])
        return reach

    def expected_accept_length(self, tree: TokenTree) -> float:
        """Sequoia's F(T): expected tokens per step, bonus included (sum of node reach probabilities)."""
        return float(math.fsum(self.node_reach_probabilities(tree)))

    def with_sources(self, counts: SourceCounts | None) -> AcceptanceProfile:
        """This profile with ``counts`` as its per-source section."""
        return AcceptanceProfile(self.rank_acceptance, dict(self.metadata), self.source, counts)

    def source_counts(self, max_ngram: int = DEFAULT_MAX_NGRAM) -> SourceCounts:
        """A fresh copy of the per-source counts (a decoder learns online in its own copy), or the generic prior
        when this profile has none. The counts must cover lookup matches up to ``max_ngram`` tokens."""
        if self.sources is None:
            return SourceCounts.generic(max_ngram)
        if self.sources.max_ngram != max_ngram:
            raise SpecError(f"{self.source}: its sources cover lookup matches up to {self.sources.max_ngram} tokens, "
                            f"the policy matches up to {max_ngram}; use max_ngram {self.sources.max_ngram}")
        return self.sources.copy()

    def to_obj(self) -> dict[str, Any]:
        values: Any = list(self.rank_acceptance[0]) if self.num_rows == 1 else [list(r) for r in self.rank_acceptance]
        obj = {"rank_acceptance": values, **self.metadata}
        if self.sources is not None:
            obj["sources"] = self.sources.to_obj()
        return obj

    def to_json(self, path: str | Path) -> None:
        """Writes the profile atomically (a failed write leaves the old file as it was)."""
        write_text_atomic(path, json.dumps(self.to_obj(), indent=1) + "\n")


def _parse_rows(values: Any, source: str) -> list[tuple[float, ...]]:
    if not isinstance(values, list) or len(values) == 0:
        raise SpecError(f"{source}: 'rank_acceptance' must be a non-empty list of floats or of lists of floats")
    nested = all(isinstance(item, list) for item in values)
    if not nested and any(isinstance(item, list) for item in values):
        raise SpecError(f"{source}: 'rank_acceptance' mixes numbers and lists; use one list or a list of lists")
    rows = values if nested else [values]
    parsed = []
    for row_index, row in enumerate(rows):
        label = f"rank_acceptance[{row_index}]" if nested else "rank_acceptance"
        if not isinstance(row, list) or len(row) == 0:
            raise SpecError(f"{source}: {label} is empty; give at least the rank-1 acceptance")
        numbers = []
        for rank, item in enumerate(row):
            value = finite_number(item)
            if value is None:
                raise SpecError(f"{source}: {label}[{rank}] = {brief(item)} is not a finite number")
            if value < 0:
                raise SpecError(
                    f"{source}: {label}[{rank}] = {value} is negative; acceptance probabilities lie in [0, 1]"
                )
            numbers.append(float(value))
        total = math.fsum(numbers)
        if total > 1 + _SUM_TOLERANCE:
            raise SpecError(
                f"{source}: {label} sums to {total:.6f} > 1; entries are exclusive probabilities "
                f"(rank k is the accepted child), so each row must sum to at most 1"
            )
        parsed.append(tuple(numbers))
    return parsed


def _mtp_bin(prob: float) -> int:
    return min(max(int(prob * MTP_BINS), 0), MTP_BINS - 1)


@dataclass
class SourceCounts:
    """The ``sources`` section of a profile: acceptance per candidate source, as (accepted, offered) counts per
    cell; an estimate is their ratio. Mutable: a decoder observes outcomes into its own copy.

    lookup[n - 1][rank]: a lookup candidate whose n-gram match has length n (1..max_ngram) and rank ``rank``.
    mtp[d - 1][bin]:     a head candidate at depth d (the last row for deeper ones) with draft probability in
                         [bin / 10, (bin + 1) / 10).
    both[n - 1]:         a token both sources proposed, the lookup's match length n.
    mtp_top1[d - 1]:     the head's rank-0 candidate at depth d (last row: deeper), whatever its probability: what
                         a head level not yet run is expected to add.
    """

    lookup: list[list[list[float]]]
    mtp: list[list[list[float]]]
    both: list[list[float]]
    mtp_top1: list[list[float]]
    source: str = "generic prior"

    @property
    def max_ngram(self) -> int:
        return len(self.lookup)

    @classmethod
    def generic(cls, max_ngram: int = DEFAULT_MAX_NGRAM, weight: float = 4.0) -> SourceCounts:
        """A weak prior for heads without a calibration: lookup acceptance rising with the match length
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
        return cls(lookup, mtp, both, top1, source="generic prior")

    @classmethod
    def from_obj(cls, obj: Any, source: str = "sources", prior_weight: float = PRIOR_WEIGHT) -> SourceCounts:
        """Parses and checks a ``sources`` section; counts above ``prior_weight`` per cell are scaled down to it."""
        try:
            lookup, mtp, both, top1 = obj["lookup"], obj["mtp"], obj["both"], obj["mtp_top1"]
            counts = cls(
                lookup=[[[float(a), float(t)] for a, t in row] for row in lookup],
                mtp=[[[float(a), float(t)] for a, t in row] for row in mtp],
                both=[[float(a), float(t)] for a, t in both],
                mtp_top1=[[float(a), float(t)] for a, t in top1],
                source=source,
            )
        except (KeyError, TypeError, ValueError, OverflowError) as error:
            raise SpecError(f"{source}: not a per-source calibration ({brief(error, 80)})") from None
        counts._check(source)
        counts._cap(prior_weight)
        return counts

    def _check(self, source: str) -> None:
        shape = (f"expected lookup [n][{LOOKUP_RANKS}], mtp [{MTP_DEPTHS}][{MTP_BINS}], both [n], "
                 f"mtp_top1 [{MTP_DEPTHS}]")
        if (not self.lookup or len(self.mtp) != MTP_DEPTHS or len(self.both) != len(self.lookup)
                or len(self.mtp_top1) != MTP_DEPTHS):
            raise SpecError(f"{source}: {shape}")
        if any(len(row) != LOOKUP_RANKS for row in self.lookup) or any(len(row) != MTP_BINS for row in self.mtp):
            raise SpecError(f"{source}: {shape}")
        for accepted, offered in self._cells():
            if (not (math.isfinite(accepted) and math.isfinite(offered)) or accepted < 0 or offered <= 0
                    or accepted > offered):
                raise SpecError(f"{source}: a cell has counts ({accepted}, {offered}); "
                                "need 0 <= accepted <= offered, offered > 0")

    def _cap(self, weight: float) -> None:
        for cell in self._cells():
            if cell[1] > weight:
                cell[0] *= weight / cell[1]
                cell[1] = weight

    def _cells(self) -> list[list[float]]:
        return ([cell for row in self.lookup for cell in row] + [c for row in self.mtp for c in row] + self.both
                + self.mtp_top1)

    def to_obj(self) -> dict[str, Any]:
        return {"lookup": self.lookup, "mtp": self.mtp, "both": self.both, "mtp_top1": self.mtp_top1}

    def named_cells(self) -> dict[str, list[float]]:
        """Every cell by a stable name: ``lookup/n/rank``, ``mtp/depth/bin``, ``both/n``, ``mtp_top1/depth``
        (1-based n and depth), the label a server exports its observed counts under."""
        cells = {f"lookup/{n}/{rank}": cell for n, row in enumerate(self.lookup, 1) for rank, cell in enumerate(row)}
        cells.update({f"mtp/{depth}/{bin_}": cell for depth, row in enumerate(self.mtp, 1)
                      for bin_, cell in enumerate(row)})
        cells.update({f"both/{n}": cell for n, cell in enumerate(self.both, 1)})
        cells.update({f"mtp_top1/{depth}": cell for depth, cell in enumerate(self.mtp_top1, 1)})
        return cells

    def with_observed(self, observed: dict[str, tuple[float, float]], source: str) -> SourceCounts:
        """A copy with ``observed`` (cell name -> (accepted, offered) outcomes) added to its cells. A name this
        table has no cell for (a longer n-gram than its max_ngram) is one clear error."""
        counts = SourceCounts.from_obj(self.to_obj(), source, prior_weight=math.inf)
        cells = counts.named_cells()
        for name, (accepted, offered) in observed.items():
            if name not in cells:
                raise SpecError(f"{source}: a count for {name!r}, which a table with max_ngram {self.max_ngram} "
                                f"does not have")
            cells[name][0] += accepted
            cells[name][1] += offered
        counts._check(source)
        return counts

    def copy(self) -> SourceCounts:
        return SourceCounts.from_obj(self.to_obj(), self.source, prior_weight=math.inf)

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
