"""Where tree policies get their draft candidates from, and the workspace they grow trees in. (Tests draw
candidates from a seeded stand-in drafter, ``tests/doubles.py``.)

A policy never sees a model: it asks a ``CandidateSource`` for the top-k candidates of some nodes of a
``GrowingTree`` (one call per expansion round, so a real drafter runs one batched forward per round) and decides
which candidates become nodes.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from sglang_spec.tree.profile import AcceptanceProfile
from sglang_spec.tree.token_tree import TokenTree


@dataclass(frozen=True, eq=False)
class Candidates:
    """Top-k draft candidates of m expanded nodes, best first.

    Fields:
      tokens: [m, k] int64. Candidate tokens, distinct within a row.
      probs:  [m, k] float32. Draft probabilities, non-increasing along a row.
    """

    tokens: torch.Tensor
    probs: torch.Tensor


def float32_product(left: float, right: float) -> float:
    """left * right rounded to float32, the way a float32 tensor multiply rounds it (SGLang's EAGLE scores)."""
    return float(np.float32(left) * np.float32(right))


class GrowingTree:
    """Append-only tree workspace. Node ids never change, node 0 is the root, and every node is added after its
    parent, so any parent-closed subset taken in increasing id order is parents-first."""

    def __init__(self, root_token: int) -> None:
        self.tokens: list[int] = [int(root_token)]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.ranks: list[int] = [-1]
        self.draft_probs: list[float] = [1.0]
        # float32 product of draft_probs along the path (EAGLE's cumulative score, SpecExec's priority)
        self.path_probs: list[float] = [1.0]

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    def add(self, parent: int, token: int, rank: int, prob: float) -> int:
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.depths.append(self.depths[parent] + 1)
        self.ranks.append(int(rank))
        self.draft_probs.append(float(prob))
        self.path_probs.append(float32_product(self.path_probs[parent], prob))
        return len(self.parents) - 1

    def add_children(self, parent: int, candidates: Candidates, row: int, count: int) -> list[int]:
        """Adds the ``count`` best candidates of ``candidates`` row ``row`` as children of ``parent``."""
        tokens = candidates.tokens[row, :count].tolist()
        probs = candidates.probs[row, :count].tolist()
        return [self.add(parent, token, rank, prob) for rank, (token, prob) in enumerate(zip(tokens, probs))]

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root to ``node`` (both included)."""
        result = []
        while node >= 0:
            result.append(self.tokens[node])
            node = self.parents[node]
        return result[::-1]

    def subtree(self, node_ids: Sequence[int] | None = None) -> TokenTree:
        """The tree made of ``node_ids`` (default: all nodes), renumbered in increasing id order."""
        ids = sorted(set(range(self.num_nodes) if node_ids is None else node_ids) | {0})
        new_index = {old: new for new, old in enumerate(ids)}
        parents = []
        for old in ids:
            parent = self.parents[old]
            if parent >= 0 and parent not in new_index:
                raise AssertionError(f"node {old} selected without its parent {parent}")
            parents.append(new_index[parent] if parent >= 0 else -1)
        return TokenTree.from_parents(
            parents,
            tokens=[self.tokens[i] for i in ids],
            ranks=[self.ranks[i] for i in ids],
            draft_probs=[self.draft_probs[i] for i in ids],
        )


class CandidateSource(abc.ABC):
    """Gives the top-k draft candidates of tree nodes (the distribution of the token that follows each node)."""

    @abc.abstractmethod
    def expand(self, tree: GrowingTree, node_ids: Sequence[int], k: int) -> Candidates:
        """Top-k candidates for each node in ``node_ids`` (rows in the same order)."""


class ProfileCandidates(CandidateSource):
    """A drafter calibrated to a profile: the rank-r child of a node at depth d has draft probability
    ``profile.acceptance(d + 1, r)``. Tokens are the ranks themselves. Used to show tree shapes without a model."""

    def __init__(self, profile: AcceptanceProfile) -> None:
        self.profile = profile

    def expand(self, tree: GrowingTree, node_ids: Sequence[int], k: int) -> Candidates:
        rows = []
        for node in node_ids:
            row = self.profile.row(tree.depths[node] + 1)
            rows.append([row[rank] if rank < len(row) else 0.0 for rank in range(k)])
        probs = torch.tensor(rows, dtype=torch.float32).reshape(len(node_ids), k)
        tokens = torch.arange(k, dtype=torch.int64).expand(len(node_ids), k).clone()
        return Candidates(tokens=tokens, probs=probs)
