"""A batch of token trees padded to one node count, the layout every verifier and kernel reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_spec.errors import SpecError
from sglang_spec.tree.token_tree import TokenTree


@dataclass(frozen=True, eq=False)
class TreeBatch:
    """B trees padded to N nodes. A request with ``num_nodes[b] == 0`` is padding: every consumer treats it as a
    no-op. All tensors live on one device.

    Fields:
      tokens:       [B, N] int64. Node tokens; -1 on padding.
      parents:      [B, N] int64. Parent index; -1 for roots and padding.
      depths:       [B, N] int64. Node depth (root 0); -1 on padding.
      first_child:  [B, N] int64. Smallest-index child; -1 when none (SGLang's retrieve_next_token, local ids).
      next_sibling: [B, N] int64. Next child of the same parent in increasing index; -1 when none
                    (SGLang's retrieve_next_sibling, local ids).
      num_nodes:    [B] int64. Real nodes per request (budget + 1), 0 for a padded request.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor
    num_nodes: torch.Tensor

    @classmethod
    def from_trees(
        cls,
        trees: Sequence[TokenTree | None],
        max_nodes: int | None = None,
        device: torch.device | str | None = None,
    ) -> TreeBatch:
        """Stacks trees (``None`` = padded request) into [B, max_nodes] tensors."""
        if len(trees) == 0:
            raise SpecError("a tree batch needs at least one request")
        needed = max((tree.num_nodes for tree in trees if tree is not None), default=1)
        width = needed if max_nodes is None else max_nodes
        if width < needed:
            raise SpecError(f"a tree has {needed} nodes but the batch holds at most {width} per request")
        batch_size = len(trees)
        tokens = torch.full((batch_size, width), -1, dtype=torch.int64)
        parents = torch.full((batch_size, width), -1, dtype=torch.int64)
        depths = torch.full((batch_size, width), -1, dtype=torch.int64)
        first_child = torch.full((batch_size, width), -1, dtype=torch.int64)
        next_sibling = torch.full((batch_size, width), -1, dtype=torch.int64)
        num_nodes = torch.zeros(batch_size, dtype=torch.int64)
        for row, tree in enumerate(trees):
            if tree is None:
                continue
            count = tree.num_nodes
            tokens[row, :count] = tree.tokens
            parents[row, :count] = tree.parents
            depths[row, :count] = tree.depths
            num_nodes[row] = count
            # Inserting children from the last index down makes the first child the smallest index and
            # chains siblings in increasing index, exactly as SGLang's build_tree kernels do.
            parent_list = tree.parents.tolist()
            for node in range(count - 1, 0, -1):
                parent = parent_list[node]
                next_sibling[row, node] = first_child[row, parent]
                first_child[row, parent] = node
        batch = cls(tokens, parents, depths, first_child, next_sibling, num_nodes)
        return batch.to(device) if device is not None else batch

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_nodes(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def max_depth(self) -> int:
        return max(int(self.depths.max()), 0)

    def to(self, device: torch.device | str) -> TreeBatch:
        return TreeBatch(*(getattr(self, name).to(device) for name in _FIELDS))


_FIELDS = ("tokens", "parents", "depths", "first_child", "next_sibling", "num_nodes")
