"""Token trees in SGLang 0.5.23's EAGLE ABI.

Two directions:

* ``encode_sglang_draft``: any tree -> the draft outputs (``parent_list``, ``top_scores_index``, ``draft_tokens``)
  that SGLang's ``build_tree_kernel_efficient`` decodes back into that tree. Node i >= 1 with parent p and
  sibling position r is written as ``top_scores_index[:, i-1] = p * topk + r`` and ``parent_list[:, i] =
  top_scores_index[:, i-1]``, so the kernel's lookup ``parent_list[top_scores_index // topk]`` finds node p
  (SGLang's UNO encoding, ``kernels/ops/speculative/uno_tree.py``).
* ``encode_sglang_verify``: the verify metadata the build-tree kernel returns (positions, retrieve index / next
  token / next sibling, tree mask in the three ``TreeMaskMode`` layouts), computed from the tree structure
  directly, so it can be checked against SGLang's own kernel (``verify_metadata``: the same from a ``TreeBatch``).
* ``decode_sglang_draft``: SGLang's native draft outputs (EAGLE-2 or UNO encoded) -> TokenTrees, their parents
  resolved by the kernel's rule (``parents_from_sglang_draft``, over the whole batch at once: what the CPU bed's
  build-tree stand-in reads).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_spec.errors import SpecError
from sglang_spec.tree.batch import TreeBatch, with_prefix
from sglang_spec.tree.bits import pack_bits_little_endian
from sglang_spec.tree.token_tree import TokenTree


class TreeMaskMode(enum.IntEnum):
    """Mirror of ``sglang.kernels.ops.speculative.spec_tree.TreeMaskMode`` (same values)."""

    FULL_MASK = 0
    QLEN_ONLY = 1
    QLEN_ONLY_BITPACKING = 2


def tree_mask_cells(mode: TreeMaskMode, prefix_lens: Sequence[int], tree_lens: Sequence[int]) -> list[int]:
    """Elements of each request's block in a tree mask of ``mode`` (blocks back to back): ``n x n`` (QLEN_ONLY),
    ``n x (prefix + n)`` (FULL_MASK), ``n`` rows of packed bits (QLEN_ONLY_BITPACKING); prefix_lens, tree_lens:
    [B] committed tokens and tree tokens of each request."""
    if mode == TreeMaskMode.QLEN_ONLY:
        return [int(new) * int(new) for new in tree_lens]
    if mode == TreeMaskMode.FULL_MASK:
        return [int(new) * (int(prefix) + int(new)) for prefix, new in zip(prefix_lens, tree_lens)]
    return [int(new) for new in tree_lens]


def complete_tree_mask(mask: torch.Tensor, mode: TreeMaskMode, prefix_lens: Sequence[int],
                       tree_lens: Sequence[int]) -> torch.Tensor:
    """``mask`` (flat, built in ``mode``) covering every request of a batch of B: as it is where it is long enough
    (SGLang sizes some masks by an upper bound); completed with attend-everything cells where it covers the blocks
    of a leading run of the requests (one at least) exactly, the rest being rows DP attention padded the verify
    batch with after the mask was built (their outputs are dropped; SGLang's FlashInfer backend pads such a mask
    the same way). Any other shortfall is a mask of another layout: ``ValueError``. Host lists in, no device
    read."""
    cells = tree_mask_cells(mode, prefix_lens, tree_lens)
    needed, covered = sum(cells), 0
    if mask.numel() >= needed:
        return mask
    for count in cells[:-1]:
        covered += count
        if covered == mask.numel():
            filler = torch.full((needed - covered,), _attend_all(mode, mask), dtype=mask.dtype, device=mask.device)
            return torch.cat([mask, filler])
    raise ValueError(f"a {mode.name} tree mask for {list(tree_lens)} tree tokens after prefixes of "
                     f"{list(prefix_lens)} has {needed} cells, got {mask.numel()}: built in another mode?")


def _attend_all(mode: TreeMaskMode, mask: torch.Tensor) -> int | bool:
    """A cell that lets its row attend everywhere: True, or every bit of a packed row."""
    if mode != TreeMaskMode.QLEN_ONLY_BITPACKING:
        return True
    return -1 if mask.dtype.is_signed else (1 << (8 * mask.element_size())) - 1


@dataclass(frozen=True, eq=False)
class SGLangDraftEncoding:
    """Draft outputs for ``build_tree_kernel_efficient`` (n = num_verify_tokens = budget + 1 per request).

    Fields:
      bonus_tokens:     [bs] int64. Root tokens (the previous step's bonus tokens).
      parent_list:      [bs, topk * (spec_steps - 1) + 1] int64. Column 0 is -1; column i (1 <= i <= n-2, while
                        it fits) is ``top_scores_index[:, i-1]``; the rest -1.
      top_scores_index: [bs, n - 1] int64. ``parent * topk + sibling position`` of nodes 1..n-1.
      draft_tokens:     [bs, n - 1] int64. Tokens of nodes 1..n-1.
      topk, spec_steps, num_verify_tokens: the static shape parameters the kernel is called with.
    """

    bonus_tokens: torch.Tensor
    parent_list: torch.Tensor
    top_scores_index: torch.Tensor
    draft_tokens: torch.Tensor
    topk: int
    spec_steps: int
    num_verify_tokens: int


@dataclass(frozen=True, eq=False)
class SGLangVerifyMetadata:
    """What ``build_tree_kernel_efficient`` returns for a batch of trees with n nodes each.

    Fields:
      tree_mask:             FULL_MASK: [sum_b n * (seq_lens[b] + n)] bool, per request n rows of prefix columns
                             (True) then tree columns, concatenated. QLEN_ONLY: [bs * n * n] bool.
                             QLEN_ONLY_BITPACKING: [bs * n] uint8 / uint16 / uint32 (n <= 8 / 16 / 32), bit c of row
                             r set when node r attends to node c (little-endian).
      positions:             [bs * n] int64. ``seq_lens[b] + depth``.
      retrieve_index:        [bs, n] int64. Global node id ``b * n + i``.
      retrieve_next_token:   [bs, n] int64. First (smallest-index) child, local id; -1 when none.
      retrieve_next_sibling: [bs, n] int64. Next sibling in increasing index, local id; -1 when none.
      draft_tokens:          [bs * n] int64. Node tokens, root (bonus token) first per request.
      mode:                  the TreeMaskMode of ``tree_mask``.
    """

    tree_mask: torch.Tensor
    positions: torch.Tensor
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor
    draft_tokens: torch.Tensor
    mode: TreeMaskMode


def parent_list_width(topk: int, spec_steps: int) -> int:
    return topk * (spec_steps - 1) + 1


def fewest_spec_steps(topk: int, budget: int) -> int:
    """The fewest draft steps whose parent_list (``parent_list_width``) indexes every parent a tree of ``budget``
    draft nodes can have: nodes 0 .. budget - 1 (a parent precedes its children)."""
    return 1 + -(-(budget - 1) // topk)


def _uniform_node_count(trees: Sequence[TokenTree]) -> int:
    if len(trees) == 0:
        raise SpecError("encode a batch of at least one tree")
    counts = {tree.num_nodes for tree in trees}
    if len(counts) != 1:
        raise SpecError(
            f"SGLang verifies a fixed number of tokens per request, but the trees have {sorted(counts)} nodes; "
            f"pad every tree to one budget"
        )
    return counts.pop()


def encode_sglang_draft(trees: Sequence[TokenTree], topk: int, spec_steps: int,
                        accept_depth: int | None = None) -> SGLangDraftEncoding:
    """Encodes trees (same node count) so SGLang's build-tree kernel reproduces them exactly.

    Needs: every node has at most ``topk`` children, depth <= ``accept_depth`` (the verify input's accept index
    has accept_depth + 1 entries; default ``spec_steps``, SGLang's own), and every parent index < topk *
    (spec_steps - 1) + 1 (the parent_list width ``spec_steps`` draft steps give).
    """
    num_nodes = _uniform_node_count(trees)
    width = parent_list_width(topk, spec_steps)
    deepest = spec_steps if accept_depth is None else accept_depth
    batch_size = len(trees)
    parent_list = torch.full((batch_size, width), -1, dtype=torch.int64)
    top_scores_index = torch.empty((batch_size, num_nodes - 1), dtype=torch.int64)
    for row, tree in enumerate(trees):
        if tree.depth > deepest:
            raise SpecError(f"tree depth {tree.depth} exceeds the accepted path's {deepest} draft tokens; raise "
                            "the tree depth")
        positions = [0] * num_nodes
        for node, parent in enumerate(tree.parents.tolist()):
            if parent < 0:
                continue
            if positions[parent] >= topk:
                raise SpecError(f"node {parent} has more than topk={topk} children; raise topk")
            if parent >= width:
                raise SpecError(
                    f"node {parent} has children but SGLang's parent_list holds only {width} entries "
                    f"(topk*(spec_steps-1)+1); raise topk or spec_steps"
                )
            top_scores_index[row, node - 1] = parent * topk + positions[parent]
            positions[parent] += 1
        usable = min(num_nodes - 1, width)
        parent_list[row, 1:usable] = top_scores_index[row, : usable - 1]
    return SGLangDraftEncoding(
        bonus_tokens=torch.stack([tree.tokens[0] for tree in trees]),
        parent_list=parent_list,
        top_scores_index=top_scores_index,
        draft_tokens=torch.stack([tree.tokens[1:] for tree in trees]),
        topk=topk,
        spec_steps=spec_steps,
        num_verify_tokens=num_nodes,
    )


def encode_sglang_verify(
    trees: Sequence[TokenTree], seq_lens: Sequence[int] | torch.Tensor, mode: TreeMaskMode = TreeMaskMode.FULL_MASK
) -> SGLangVerifyMetadata:
    """Verify metadata for trees with the same node count; ``seq_lens[b]`` = verified prefix length."""
    _uniform_node_count(trees)
    return verify_metadata(TreeBatch.from_trees(trees), seq_lens, mode)


def verify_metadata(batch: TreeBatch, seq_lens: Sequence[int] | torch.Tensor,
                    mode: TreeMaskMode = TreeMaskMode.FULL_MASK) -> SGLangVerifyMetadata:
    """``encode_sglang_verify``'s metadata for a batch whose every request holds all ``batch.max_nodes`` nodes
    (SGLang verifies a fixed number a request); ``seq_lens[b]`` = verified prefix length."""
    num_nodes = batch.max_nodes
    batch_size = batch.batch_size
    seq_lens = torch.as_tensor(seq_lens, dtype=torch.int64).reshape(-1)
    if seq_lens.numel() != batch_size:
        raise SpecError(f"got {seq_lens.numel()} seq_lens for {batch_size} trees")
    masks = batch.ancestor_mask()
    if mode == TreeMaskMode.FULL_MASK:
        tree_mask = torch.cat(
            [with_prefix(mask, int(prefix)).reshape(-1) for prefix, mask in zip(seq_lens.tolist(), masks)]
        )
    elif mode == TreeMaskMode.QLEN_ONLY:
        tree_mask = masks.reshape(-1)
    elif mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
        tree_mask = pack_rows_little_endian(masks.reshape(batch_size * num_nodes, num_nodes))
    else:
        raise SpecError(f"unknown tree mask mode {mode!r}")
    return SGLangVerifyMetadata(
        tree_mask=tree_mask,
        positions=(seq_lens[:, None] + batch.depths).reshape(-1),
        retrieve_index=torch.arange(batch_size * num_nodes, dtype=torch.int64).reshape(batch_size, num_nodes),
        retrieve_next_token=batch.first_child,
        retrieve_next_sibling=batch.next_sibling,
        draft_tokens=batch.tokens.reshape(-1),
        mode=mode,
    )


def pack_rows_little_endian(rows: torch.Tensor) -> torch.Tensor:
    """[R, n] bool -> [R] uint8/uint16/uint32 with bit c = column c (SGLang's QLEN_ONLY_BITPACKING, n <= 32)."""
    num_columns = rows.shape[1]
    if num_columns > 32:
        raise SpecError(f"QLEN_ONLY_BITPACKING holds at most 32 tree tokens per request, got {num_columns}")
    num_bytes = {1: 1, 2: 2, 3: 4, 4: 4}[(num_columns + 7) // 8]
    padded = torch.zeros(rows.shape[0], num_bytes * 8, dtype=torch.bool)
    padded[:, :num_columns] = rows
    packed = pack_bits_little_endian(padded.reshape(-1))
    dtype = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}[num_bytes]
    return packed.contiguous().view(dtype).reshape(-1)


def parents_from_sglang_draft(parent_list: torch.Tensor, top_scores_index: torch.Tensor, topk: int) -> torch.Tensor:
    """[bs, n] int64 parents (node 0 the root, -1) of the trees SGLang's draft outputs encode, resolved the way the
    build-tree kernel resolves them: node i's parent slot is ``g = top_scores_index[i-1] // topk``; g == 0 means the
    root, otherwise the parent is the first node whose top_scores_index equals ``parent_list[g]``. parent_list
    [bs, topk * (spec_steps - 1) + 1], top_scores_index [bs, n - 1] (EAGLE-2 or UNO encoded). A slot past
    parent_list, a parent slot that names no selected node, or a parent after its child: ``SpecError``."""
    batch_size, count = top_scores_index.shape
    slots = top_scores_index // topk
    outside = (slots < 0) | ((slots != 0) & (slots >= parent_list.shape[1]))  # slot 0 (the root) reads no entry
    if bool(outside.any()):
        row = int(outside.any(1).nonzero()[0])
        raise SpecError(f"invalid eagle tree: request {row} has a parent slot past its parent_list "
                        f"({parent_list.shape[1]} entries)")
    padded = torch.cat([parent_list, torch.full((batch_size, 1), -1, dtype=parent_list.dtype,
                                                device=parent_list.device)], 1)  # one draft step's is empty
    parent_values = torch.gather(padded, 1, torch.where(slots == 0, parent_list.shape[1], slots))
    positions = torch.arange(count, device=top_scores_index.device)
    matches = top_scores_index[:, None, :] == parent_values[:, :, None]  # [bs, node, candidate parent]
    first = torch.where(matches, positions, count).min(-1).values
    unselected = (slots != 0) & (first == count)
    if bool(unselected.any()):
        row = int(unselected.any(1).nonzero()[0])
        raise SpecError(f"invalid eagle tree: request {row} has a node whose parent slot is not selected")
    parents = torch.where(slots == 0, 0, first + 1)
    late = parents > positions  # column c holds node c + 1, whose parent must come before it
    if bool(late.any()):
        row = int(late.any(1).nonzero()[0])
        raise SpecError(f"invalid eagle tree: request {row} has a node whose parent comes after it")
    return torch.cat([torch.full((batch_size, 1), -1, dtype=torch.int64, device=parents.device), parents], 1)


def decode_sglang_draft(
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    draft_tokens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    topk: int,
    draft_probs: torch.Tensor | None = None,
) -> list[TokenTree]:
    """Trees from SGLang draft outputs, their parents resolved as the build-tree kernel resolves them
    (``parents_from_sglang_draft``); ranks are ``top_scores_index % topk``."""
    parents = parents_from_sglang_draft(parent_list, top_scores_index, topk).tolist()
    trees = []
    for row in range(top_scores_index.shape[0]):
        scores_index = top_scores_index[row].tolist()
        probs = None if draft_probs is None else [1.0, *draft_probs[row].tolist()]
        trees.append(
            TokenTree.from_parents(
                parents[row],
                tokens=[int(bonus_tokens[row]), *draft_tokens[row].tolist()],
                ranks=[-1, *[value % topk for value in scores_index]],
                draft_probs=probs,
            )
        )
    return trees


def encode_sglang_draft_device(parents: torch.Tensor, tokens: torch.Tensor, topk: int,
                               spec_steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``encode_sglang_draft``'s (parent_list, top_scores_index, draft_tokens) for a batch of trees held as device
    tensors, with no host read: parents / tokens [bs, n] int64, node 0 the root (parent -1), parents before
    children. The trees must meet ``encode_sglang_draft``'s needs (at most ``topk`` children a node, depth <=
    ``spec_steps``, parents below the parent_list width); this form does not check them."""
    batch_size, num_nodes = parents.shape
    width = parent_list_width(topk, spec_steps)
    nodes = torch.arange(num_nodes, device=parents.device)
    # sibling position of node i: the nodes before it with its parent
    earlier = (parents[:, None, :] == parents[:, :, None]) & (nodes[None, None, :] < nodes[None, :, None])
    sibling = earlier.long().sum(2)
    top_scores_index = (parents * topk + sibling)[:, 1:]
    parent_list = torch.full((batch_size, width), -1, dtype=torch.int64, device=parents.device)
    usable = min(num_nodes - 1, width)
    parent_list[:, 1:usable] = top_scores_index[:, : usable - 1]
    return parent_list, top_scores_index.contiguous(), tokens[:, 1:].contiguous()
