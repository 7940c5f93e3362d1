"""Positional acceptance profiles: P(the rank-k child is the accepted one | its parent was accepted).

File format (JSON): ``{"rank_acceptance": [...], ...}`` where ``rank_acceptance`` is either one list of floats
(the same for every depth) or a list of lists (row d-1 for draft nodes at depth d; the last row repeats for deeper
nodes). Entry k is for the (k+1)-th ranked candidate. Other keys are kept as metadata.

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
from sglang_spec.tree.token_tree import TokenTree

_SUM_TOLERANCE = 1e-5
DEFAULT_PROFILE = "sequoia_demo.json"


@dataclass(frozen=True)
class AcceptanceProfile:
    """rank_acceptance[d][k]: probability that the k-th ranked (0-based) child of an accepted node at depth d is
    accepted (so the child sits at depth d + 1). Rows are padded with zeros to one width; the last row repeats
    for deeper nodes. Every row sums to at most 1 (the rest is "no child accepted"). ``source`` says where the
    profile came from (a path, or the built-in name), for reports."""

    rank_acceptance: tuple[tuple[float, ...], ...]
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)
    source: str = field(default="profile", compare=False)

    @classmethod
    def from_obj(cls, obj: Any, source: str = "profile") -> AcceptanceProfile:
        if isinstance(obj, dict):
            if "rank_acceptance" not in obj:
                raise SpecError(f"{source}: missing key 'rank_acceptance' (a list of floats or a list of lists)")
            values = obj["rank_acceptance"]
            metadata = {key: value for key, value in obj.items() if key != "rank_acceptance"}
        else:
            values, metadata = obj, {}
        rows = _parse_rows(values, source)
        width = max(len(row) for row in rows)
        padded = tuple(tuple(row) + (0.0,) * (width - len(row)) for row in rows)
        return cls(rank_acceptance=padded, metadata=metadata, source=source)

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

    def to_obj(self) -> dict[str, Any]:
        values: Any = list(self.rank_acceptance[0]) if self.num_rows == 1 else [list(r) for r in self.rank_acceptance]
        return {"rank_acceptance": values, **self.metadata}

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
