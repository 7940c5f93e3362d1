"""What a draft token tree is.

Conventions used everywhere in sglang_spec (CLI, docs, kernels, plugin):

* node 0 is the root: the last verified token, whose KV is not yet written; the target's output at the root
  gives the first new token, so a step always yields at least one token;
* nodes are in parents-first order (``parents[i] < i``), ``-1`` means "no parent" (root) or padding;
* ``budget`` = number of draft nodes, root excluded (SGLang's ``num_draft_tokens`` = budget + 1);
* ``depth`` = the most draft tokens on one root-to-leaf path;
* accept length = accepted draft tokens + 1 (the bonus token), so a tree's expected accept length is Sequoia's F(T).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_spec.errors import SpecError

# SGLang's JIT tree kernel runs one CUDA block of `num_draft_tokens` threads, so a tree has at most 1024 nodes.
MAX_TREE_NODES = 1024
MAX_BUDGET = MAX_TREE_NODES - 1
MAX_DEPTH = 64


@dataclass(frozen=True, eq=False)
class TokenTree:
    """One request's draft tree (n = budget + 1 nodes, parents-first, node 0 = root).

    Fields, all 1-D of length n on the CPU:
      tokens:      int64. Token of each node; ``tokens[0]`` is the root (last verified) token.
      parents:     int64. Parent node index; ``parents[0] = -1`` and ``0 <= parents[i] < i`` for i >= 1.
      depths:      int64. ``depths[0] = 0``; ``depths[i] = depths[parents[i]] + 1``.
      ranks:       int64. 0-based rank of the node among its parent's draft candidates (its top-k index);
                   ``ranks[0] = -1``. Sibling ranks are distinct.
      draft_probs: float32. Draft probability of the node's token given its parent's path; ``draft_probs[0] = 1``.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ranks: torch.Tensor
    draft_probs: torch.Tensor

    @classmethod
    def from_parents(
        cls,
        parents: Sequence[int] | torch.Tensor,
        tokens: Sequence[int] | torch.Tensor | None = None,
        ranks: Sequence[int] | torch.Tensor | None = None,
        draft_probs: Sequence[float] | torch.Tensor | None = None,
        max_depth: int | None = None,
    ) -> TokenTree:
        """Builds and validates a tree from parent indices. Missing fields get defaults: tokens = node index,
        ranks = order among siblings, draft_probs = 1."""
        parent_list = [int(p) for p in (parents.tolist() if torch.is_tensor(parents) else parents)]
        _check_parents(parent_list)
        num_nodes = len(parent_list)
        depths = [0] * num_nodes
        sibling_count = [0] * num_nodes
        default_ranks = [-1] * num_nodes
        for node in range(1, num_nodes):
            parent = parent_list[node]
            depths[node] = depths[parent] + 1
            default_ranks[node] = sibling_count[parent]
            sibling_count[parent] += 1
        tree = cls(
            tokens=_as_int64(tokens if tokens is not None else list(range(num_nodes))),
            parents=torch.tensor(parent_list, dtype=torch.int64),
            depths=torch.tensor(depths, dtype=torch.int64),
            ranks=_as_int64(ranks if ranks is not None else default_ranks),
            draft_probs=torch.as_tensor(
                draft_probs if draft_probs is not None else [1.0] * num_nodes, dtype=torch.float32
            ),
        )
        return tree.validate(max_depth=max_depth)

    @property
    def num_nodes(self) -> int:
        return int(self.parents.numel())

    @property
    def budget(self) -> int:
        """Number of draft nodes (root excluded)."""
        return self.num_nodes - 1

    @property
    def depth(self) -> int:
        """The most draft tokens on one root-to-leaf path."""
        return int(self.depths.max())

    def children(self) -> list[list[int]]:
        """children()[i] = node i's children in increasing index order (SGLang's sibling order)."""
        result: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for node, parent in enumerate(self.parents.tolist()):
            if parent >= 0:
                result[parent].append(node)
        return result

    def path(self, node: int) -> list[int]:
        """Node ids from the root to ``node`` (both included)."""
        parents = self.parents.tolist()
        result = [node]
        while parents[result[-1]] >= 0:
            result.append(parents[result[-1]])
        return result[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool; row i is True at i, its ancestors and the root (tree attention mask)."""
        return ancestor_masks(self.parents[None, :])[0]

    def validate(self, max_depth: int | None = None) -> TokenTree:
        """Checks every invariant in the class docstring; raises SpecError (one line) on the first violation.
        Returns self so construction can chain."""
        num_nodes = int(self.parents.numel())
        for name in ("tokens", "parents", "depths", "ranks", "draft_probs"):
            value = getattr(self, name)
            if not torch.is_tensor(value) or value.dim() != 1 or value.numel() != num_nodes:
                raise SpecError(
                    f"tree field {name!r} must be a 1-D tensor with one entry per node ({num_nodes}), "
                    f"got {tuple(value.shape) if torch.is_tensor(value) else type(value).__name__}"
                )
        parents = self.parents.tolist()
        _check_parents(parents)
        depths = self.depths.tolist()
        if depths[0] != 0:
            raise SpecError(f"the root (node 0) must have depth 0, got {depths[0]}")
        for node in range(1, num_nodes):
            if depths[node] != depths[parents[node]] + 1:
                raise SpecError(
                    f"node {node} has depth {depths[node]} but its parent {parents[node]} has depth "
                    f"{depths[parents[node]]}; depths must grow by 1 along every edge"
                )
        if max_depth is not None and num_nodes > 1 and max(depths) > max_depth:
            raise SpecError(
                f"tree depth {max(depths)} exceeds the maximum depth {max_depth}; "
                f"prune the tree or raise the depth limit"
            )
        if num_nodes > MAX_TREE_NODES:
            raise SpecError(
                f"tree has {num_nodes} nodes; at most {MAX_TREE_NODES} (budget {MAX_BUDGET}) are supported"
            )
        ranks = self.ranks.tolist()
        if ranks[0] != -1:
            raise SpecError(f"the root (node 0) must have rank -1, got {ranks[0]}")
        tokens = self.tokens.tolist()
        seen_ranks: dict[tuple[int, int], int] = {}
        seen_tokens: dict[tuple[int, int], int] = {}
        for node in range(1, num_nodes):
            parent = parents[node]
            if ranks[node] < 0:
                raise SpecError(f"node {node} has rank {ranks[node]}; draft ranks are 0-based and >= 0")
            if (parent, ranks[node]) in seen_ranks:
                raise SpecError(
                    f"nodes {seen_ranks[(parent, ranks[node])]} and {node} are both rank {ranks[node]} "
                    f"children of node {parent}; sibling ranks must be distinct"
                )
            seen_ranks[(parent, ranks[node])] = node
            if (parent, tokens[node]) in seen_tokens:
                raise SpecError(
                    f"nodes {seen_tokens[(parent, tokens[node])]} and {node} are both children of node "
                    f"{parent} with token {tokens[node]}; sibling tokens must be distinct"
                )
            seen_tokens[(parent, tokens[node])] = node
        probs = self.draft_probs
        if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()) or bool((probs > 1).any()):
            raise SpecError("draft_probs must be finite probabilities in [0, 1]")
        return self

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens.tolist(),
            "parents": self.parents.tolist(),
            "depths": self.depths.tolist(),
            "ranks": self.ranks.tolist(),
            "draft_probs": [round(float(p), 6) for p in self.draft_probs.tolist()],
        }


def _as_int64(values: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64).reshape(-1)


def _check_parents(parents: list[int]) -> None:
    """Root first with parent -1, every other parent earlier in the list; names a cycle when there is one."""
    num_nodes = len(parents)
    if num_nodes == 0:
        raise SpecError("a tree needs at least its root node")
    if parents[0] != -1:
        raise SpecError(f"node 0 is the root and must have parent -1, got {parents[0]}")
    for node in range(1, num_nodes):
        parent = parents[node]
        if parent == -1:
            raise SpecError(f"node {node} has parent -1; only the root (node 0) may have no parent")
        if parent < -1 or parent >= num_nodes:
            raise SpecError(f"node {node} has parent {parent}, outside the tree's nodes 0..{num_nodes - 1}")
        if parent >= node:
            cycle = _find_cycle(parents, node)
            if cycle:
                raise SpecError(
                    f"parents form a cycle through nodes {' -> '.join(map(str, cycle))}; a tree has no cycles"
                )
            raise SpecError(
                f"node {node} has parent {parent}, which comes after it; nodes must be in parents-first order "
                f"(renumber so every parent precedes its children)"
            )


def _find_cycle(parents: list[int], start: int) -> list[int]:
    order: list[int] = []
    position: dict[int, int] = {}
    node = start
    while 0 <= node < len(parents) and node not in position:
        position[node] = len(order)
        order.append(node)
        node = parents[node]
    if node in position:
        return order[position[node] :] + [node]
    return []


def ancestor_masks(parents: torch.Tensor) -> torch.Tensor:
    """The tree attention mask: parents [B, N] int64 (-1: no parent) -> [B, N, N] bool, row i True at i, its
    ancestors and the root. A padding row (a node no tree holds) is True at the root column and its own column
    only, so attention over it stays defined and nothing real attends to it."""
    return ancestors_or_self(parents) | root_column(parents)


def ancestors_or_self(parents: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool: row i is True at i and at every node reached by following parents up from i."""
    batch_size, width = parents.shape
    node = torch.arange(width, device=parents.device)
    mask = (node[:, None] == node[None, :]).expand(batch_size, width, width).clone()
    current = parents
    rows = torch.arange(batch_size, device=parents.device)[:, None]
    for _ in range(width):  # a path up is at most N - 1 steps long
        up = current >= 0
        if not bool(up.any()):
            return mask
        mask |= up[..., None] & (node[None, None, :] == current[..., None])
        current = torch.where(up, parents[rows, current.clamp(min=0)], -1)
    raise SpecError("tree parents form a cycle; every node's parent chain must end at the root")


def root_column(parents: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool, True in column 0."""
    batch_size, width = parents.shape
    column = torch.arange(width, device=parents.device) == 0
    return column.expand(batch_size, width, width)
