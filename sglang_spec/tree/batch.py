"""A batch of token trees padded to one node count: the one host structure every encoder, verifier, the reference
decoder and the kernels' pure-torch references read.

It owns what is derived from the parent pointers: depths, SGLang-style first-child / next-sibling links, the
ancestor mask, the attention mask over a verified prefix plus the tree, and FlashInfer's ``plan()`` inputs.
Everything is computed with tensor operations over the whole batch (no per-node host loops).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch

from sglang_spec.errors import SpecError
from sglang_spec.tree.bits import pack_bits_little_endian
from sglang_spec.tree.token_tree import TokenTree, ancestor_masks, ancestors_or_self


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
        tokens = torch.full((len(trees), width), -1, dtype=torch.int64)
        parents = torch.full((len(trees), width), -1, dtype=torch.int64)
        num_nodes = torch.zeros(len(trees), dtype=torch.int64)
        for row, tree in enumerate(trees):
            if tree is not None:
                tokens[row, : tree.num_nodes] = tree.tokens
                parents[row, : tree.num_nodes] = tree.parents
                num_nodes[row] = tree.num_nodes
        batch = cls.from_parents(tokens, parents, num_nodes)
        return batch.to(device) if device is not None else batch

    @classmethod
    def from_parents(cls, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor) -> TreeBatch:
        """The batch of the padded layout the kernels use: tokens / parents [B, N] int64 (node 0 the root; entries
        at or past ``num_nodes[b]`` are ignored), num_nodes [B] int64. Computes depths and links on the inputs'
        device."""
        batch_size, width = parents.shape
        node = torch.arange(width, device=parents.device)
        real = node[None, :] < num_nodes[:, None]
        parents = torch.where(real & (node[None, :] > 0), parents, -1)
        tokens = torch.where(real, tokens, -1)
        ancestors = ancestors_or_self(parents)
        depths = torch.where(real, ancestors.sum(-1) - 1, -1)
        # child c of node p: parents[c] == p; the smallest such c is p's first child, the next larger c with the
        # same parent is c's next sibling (SGLang's build_tree order)
        none = torch.full((), width, device=parents.device)
        child_of = parents[:, None, :] == node[None, :, None]  # [B, p, c]
        first_child = torch.where(child_of, node, none).min(-1).values
        same_parent = (parents[:, None, :] == parents[:, :, None]) & (parents[:, :, None] >= 0)  # [B, c, c']
        later = node[None, None, :] > node[None, :, None]
        next_sibling = torch.where(same_parent & later, node, none).min(-1).values
        return cls(
            tokens=tokens,
            parents=parents,
            depths=depths,
            first_child=torch.where(first_child < width, first_child, -1),
            next_sibling=torch.where(next_sibling < width, next_sibling, -1),
            num_nodes=num_nodes,
        )

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
        return TreeBatch(**{field.name: getattr(self, field.name).to(device) for field in fields(self)})

    def ancestor_mask(self) -> torch.Tensor:
        """[B, N, N] bool, the tree attention mask: row i is True at i, its ancestors and the root. A padding row
        (i >= num_nodes[b]) is True at the root column and its own column only, so attention over it stays
        defined and nothing real attends to it."""
        return ancestor_masks(self.parents)

    def attention_mask(self, prefix_lens: Sequence[int] | torch.Tensor, tree_start: int | None = None) -> torch.Tensor:
        """[B, N, S + N] bool over keys = S prefix slots, then the N tree nodes (S = ``tree_start``, default the
        longest prefix): request b's rows see its first ``prefix_lens[b]`` slots and, among the tree columns, the
        ancestor mask."""
        lengths = _as_lengths(prefix_lens, self.batch_size)
        start = max(lengths, default=0) if tree_start is None else tree_start
        if any(length > start for length in lengths):
            raise SpecError(f"a prefix of {max(lengths)} slots does not fit before the tree at slot {start}")
        ancestors = self.ancestor_mask()
        return torch.stack([with_prefix(ancestors[row], length, start) for row, length in enumerate(lengths)])

    def flashinfer_plan(self, prefix_lens: Sequence[int] | torch.Tensor, page_size: int = 1) -> FlashInferPlan:
        """FlashInfer's plan() inputs for tree verify: request b's queries are its ``num_nodes[b]`` real nodes
        (a padded request has none), its keys the ``prefix_lens[b]`` verified tokens then those nodes."""
        lengths = _as_lengths(prefix_lens, self.batch_size)
        query_lens = self.num_nodes.tolist()
        ancestors = self.ancestor_mask()
        blocks = [
            with_prefix(ancestors[row, :count, :count], length).reshape(-1)
            for row, (count, length) in enumerate(zip(query_lens, lengths))
        ]
        indptrs = plan_indptrs(query_lens, lengths, page_size)
        return FlashInferPlan(
            **{field.name: getattr(indptrs, field.name) for field in fields(indptrs)},
            custom_mask=torch.cat(blocks),
            mask_indptr=_indptr([block.numel() for block in blocks]),
            packed_mask=torch.cat([pack_bits_little_endian(block) for block in blocks]),
        )


def with_prefix(tree_mask: torch.Tensor, prefix_len: int, tree_start: int | None = None) -> torch.Tensor:
    """[q, prefix_len ... tree_start, tree_start + n] bool: every row sees the ``prefix_len`` prefix columns, nothing
    up to ``tree_start`` (default: ``prefix_len``), then its row of ``tree_mask`` [q, n]."""
    start = prefix_len if tree_start is None else tree_start
    rows, nodes = tree_mask.shape
    mask = torch.zeros(rows, start + nodes, dtype=torch.bool, device=tree_mask.device)
    mask[:, :prefix_len] = True
    mask[:, start:] = tree_mask.bool()
    return mask


@dataclass(frozen=True, eq=False)
class FlashInferIndptrs:
    """Index pointers of FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper.plan()`` for B requests with q_b query
    rows and kv_b = prefix_b + q_b keys each.

    Fields:
      qo_indptr:              [B + 1] int32. Cumulative q_b.
      paged_kv_indptr:        [B + 1] int32. Cumulative pages, ceil(kv_b / page_size) per request.
      paged_kv_last_page_len: [B] int32. Tokens in each request's last page (page_size when full; 0 without pages).
      packed_mask_indptr:     [B + 1] int32. Byte offsets of the packed mask blocks, ceil(q_b * kv_b / 8) each.
    """

    qo_indptr: torch.Tensor
    paged_kv_indptr: torch.Tensor
    paged_kv_last_page_len: torch.Tensor
    packed_mask_indptr: torch.Tensor

    @classmethod
    def empty(cls, batch_size: int, device: torch.device | str) -> FlashInferIndptrs:
        def ints(size: int) -> torch.Tensor:
            return torch.empty(size, dtype=torch.int32, device=device)

        return cls(ints(batch_size + 1), ints(batch_size + 1), ints(batch_size), ints(batch_size + 1))


def plan_indptrs(
    query_lens: Sequence[int] | torch.Tensor, prefix_lens: Sequence[int] | torch.Tensor, page_size: int = 1
) -> FlashInferIndptrs:
    """The index-pointer arithmetic (CPU tensors) for requests with ``query_lens[b]`` tree rows after
    ``prefix_lens[b]`` verified tokens."""
    if page_size < 1:
        raise SpecError(f"page_size must be >= 1, got {page_size}")
    queries = torch.as_tensor(query_lens, dtype=torch.int64).reshape(-1).cpu()
    kv_lens = torch.as_tensor(prefix_lens, dtype=torch.int64).reshape(-1).cpu() + queries
    pages = (kv_lens + page_size - 1) // page_size
    last_page = torch.where(pages > 0, kv_lens - (pages - 1) * page_size, 0)
    return FlashInferIndptrs(
        qo_indptr=_indptr(queries.tolist()),
        paged_kv_indptr=_indptr(pages.tolist()),
        paged_kv_last_page_len=last_page.to(torch.int32),
        packed_mask_indptr=_indptr(((queries * kv_lens + 7) // 8).tolist()),
    )


@dataclass(frozen=True, eq=False)
class FlashInferPlan:
    """Everything ``plan(..., custom_mask=...)`` needs for tree verify (see ``TreeBatch.flashinfer_plan``): the
    four FlashInferIndptrs fields, and

      custom_mask:  [sum q_b * kv_b] bool. Each request's q_b x kv_b block row-major (all prefix columns, then the
                    ancestor mask), concatenated.
      mask_indptr:  [B + 1] int32. Element offsets of the blocks in ``custom_mask``.
      packed_mask:  [sum ceil(q_b * kv_b / 8)] uint8. Each block packed little-endian (bit j of byte i = element
                    8 i + j of the block) and padded to a whole byte, like ``segment_packbits(bitorder="little")``.
    """

    qo_indptr: torch.Tensor
    paged_kv_indptr: torch.Tensor
    paged_kv_last_page_len: torch.Tensor
    packed_mask_indptr: torch.Tensor
    custom_mask: torch.Tensor
    mask_indptr: torch.Tensor
    packed_mask: torch.Tensor


def encode_flashinfer_mask(
    trees: Sequence[TokenTree | None], prefix_lens: Sequence[int] | torch.Tensor, page_size: int = 1
) -> FlashInferPlan:
    """The FlashInfer plan for trees of any sizes (``None`` = padded request) after their verified prefixes."""
    lengths = _as_lengths(prefix_lens, len(trees))
    return TreeBatch.from_trees(trees).flashinfer_plan(lengths, page_size)


def _as_lengths(prefix_lens: Sequence[int] | torch.Tensor, batch_size: int) -> list[int]:
    lengths = [int(length) for length in torch.as_tensor(prefix_lens).reshape(-1).tolist()]
    if len(lengths) != batch_size:
        raise SpecError(f"got {len(lengths)} prefix lengths for {batch_size} trees")
    if any(length < 0 for length in lengths):
        raise SpecError("prefix lengths must be >= 0")
    return lengths


def _indptr(lengths: Sequence[int]) -> torch.Tensor:
    indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        indptr[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
    return indptr
