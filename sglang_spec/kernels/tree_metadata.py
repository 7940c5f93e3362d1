"""Tree metadata on the device: from draft candidates and a topology to everything verify needs.

Inputs describe a padded batch of B requests with N tree slots each (node 0 = root). Node i >= 1 takes the
``ranks[b, i]``-th candidate drafted at its parent: ``tokens[b, i] = topk_tokens[b, parents[b, i], ranks[b, i]]``.
A node with ``i >= num_nodes[b]`` is padding; a request with ``num_nodes[b] == 0`` is entirely padding.

Padding stays harmless in a static-shape forward: a padded node gets the root token as its input id, the request's
prefix length as its position, and a mask row with only the root column and its own column, so attention is well
defined and nothing real attends to it; verify never visits it.

Three kernels, each with its launcher and a pure-torch reference of identical semantics:
* ``build_tree_metadata``: tokens, input ids, draft probabilities, depths, positions, first-child / next-sibling
  links, retrieve index and the [B, N, N] ancestor-or-self mask (one program per request).
* ``flashinfer_indptrs``: qo / paged-kv / packed-mask indptrs and last-page lengths (one program).
* ``pack_flashinfer_mask``: each request's N x (prefix + N) rows, prefix columns all ones, packed little-endian
  into whole bytes per request, exactly like FlashInfer's ``segment_packbits(..., bitorder="little")``.
* ``parents_from_links``: the parent array from first-child / next-sibling links (SGLang's ``retrieve_next_token``
  / ``retrieve_next_sibling``, local ids), so a verify step that only has SGLang's layout can run the walk.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from sglang_spec.tree.batch import FlashInferIndptrs, TreeBatch, plan_indptrs, with_prefix
from sglang_spec.tree.bits import pack_bits_little_endian

ROW_BLOCK = 16


@dataclass(frozen=True, eq=False)
class TreeMetadata:
    """Outputs of ``build_tree_metadata`` (all on one device; -1 marks padding unless noted).

    Fields:
      tokens:         [B, N] int64. Node tokens, root first; -1 on padding.
      input_ids:      [B * N] int64. Forward input: node tokens, the root token on padding.
      draft_probs:    [B, N] float32. Draft probability of each node (root 1, padding 0).
      depths:         [B, N] int64. Root 0; -1 on padding.
      positions:      [B * N] int64. prefix_len + depth (prefix_len on padding).
      parents:        [B, N] int64. Root and padding -1.
      first_child:    [B, N] int64. Smallest-index child, -1 when none.
      next_sibling:   [B, N] int64. Next child of the same parent by index, -1 when none.
      retrieve_index: [B, N] int64. Global node id b * N + i.
      tree_mask:      [B, N, N] uint8. 1 where row node attends to column node (ancestors, itself, the root).
    """

    tokens: torch.Tensor
    input_ids: torch.Tensor
    draft_probs: torch.Tensor
    depths: torch.Tensor
    positions: torch.Tensor
    parents: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor
    retrieve_index: torch.Tensor
    tree_mask: torch.Tensor

    @classmethod
    def empty(cls, batch_size: int, num_nodes: int, device: torch.device | str) -> TreeMetadata:
        def ints(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=torch.int64, device=device)

        return cls(
            tokens=ints(batch_size, num_nodes),
            input_ids=ints(batch_size * num_nodes),
            draft_probs=torch.empty(batch_size, num_nodes, dtype=torch.float32, device=device),
            depths=ints(batch_size, num_nodes),
            positions=ints(batch_size * num_nodes),
            parents=ints(batch_size, num_nodes),
            first_child=ints(batch_size, num_nodes),
            next_sibling=ints(batch_size, num_nodes),
            retrieve_index=ints(batch_size, num_nodes),
            tree_mask=torch.empty(batch_size, num_nodes, num_nodes, dtype=torch.uint8, device=device),
        )


@triton.jit
def _tree_metadata_kernel(
    parents_ptr,  # [B, N] int64 parent per node (row stride parents_stride; 0 broadcasts one topology)
    parents_stride,
    ranks_ptr,  # [B, N] int64 candidate rank per node (row stride ranks_stride)
    ranks_stride,
    topk_tokens_ptr,  # [B, N, K] int64 candidates drafted at each node
    topk_probs_ptr,  # [B, N, K] float32 their draft probabilities
    root_tokens_ptr,  # [B] int64
    prefix_lens_ptr,  # [B] int64 verified prefix length
    num_nodes_ptr,  # [B] int64 real nodes per request (0 = padded request)
    tokens_ptr,  # out [B, N] int64
    input_ids_ptr,  # out [B * N] int64
    draft_probs_ptr,  # out [B, N] float32
    depths_ptr,  # out [B, N] int64
    positions_ptr,  # out [B * N] int64
    parents_out_ptr,  # out [B, N] int64
    first_child_ptr,  # out [B, N] int64
    next_sibling_ptr,  # out [B, N] int64
    retrieve_index_ptr,  # out [B, N] int64
    tree_mask_ptr,  # out [B, N, N] uint8
    N: tl.constexpr,
    K: tl.constexpr,
    N_PAD: tl.constexpr,
    MAX_DEPTH: tl.constexpr,
    ROWS: tl.constexpr,
):
    # one program per request; nodes are processed in blocks of ROWS against all N_PAD columns
    b = tl.program_id(0)
    num_nodes = tl.load(num_nodes_ptr + b)
    prefix = tl.load(prefix_lens_ptr + b)
    root_token = tl.load(root_tokens_ptr + b)
    columns = tl.arange(0, N_PAD)
    column_real = columns < num_nodes
    column_parent = tl.load(parents_ptr + b * parents_stride + columns, mask=column_real & (columns > 0), other=-1)
    for row_start in range(0, N_PAD, ROWS):
        rows = row_start + tl.arange(0, ROWS)
        in_range = rows < N
        real = rows < num_nodes
        parent = tl.load(parents_ptr + b * parents_stride + rows, mask=real & (rows > 0), other=-1)
        rank = tl.load(ranks_ptr + b * ranks_stride + rows, mask=real & (rows > 0), other=0)
        candidate = b * N * K + tl.maximum(parent, 0) * K + rank
        is_draft = real & (rows > 0)
        draft_token = tl.load(topk_tokens_ptr + candidate, mask=is_draft, other=-1)
        draft_prob = tl.load(topk_probs_ptr + candidate, mask=is_draft, other=0.0)
        token = tl.where(rows == 0, tl.where(num_nodes > 0, root_token, -1), draft_token)
        prob = tl.where(real & (rows == 0), 1.0, draft_prob)

        # walk up from the parent: every visited node is an ancestor, the number of steps is the depth
        ancestors = (rows[:, None] == columns[None, :]) | (columns[None, :] == 0)
        depth = tl.zeros([ROWS], dtype=tl.int64)
        current = parent
        for _ in range(MAX_DEPTH):
            up = current >= 0
            ancestors = ancestors | ((current[:, None] == columns[None, :]) & up[:, None])
            depth += up.to(tl.int64)
            next_up = tl.load(parents_ptr + b * parents_stride + tl.maximum(current, 0), mask=up & (current > 0),
                              other=-1)
            current = tl.where(up & (current > 0), next_up, -1)

        child_of_row = (column_parent[None, :] == rows[:, None]) & column_real[None, :] & real[:, None]
        first_child = tl.min(tl.where(child_of_row, columns[None, :], N_PAD), axis=1)
        sibling = (
            (column_parent[None, :] == parent[:, None])
            & (columns[None, :] > rows[:, None])
            & column_real[None, :]
            & (parent[:, None] >= 0)
        )
        next_sibling = tl.min(tl.where(sibling, columns[None, :], N_PAD), axis=1)

        out = b * N + rows
        tl.store(tokens_ptr + out, token, mask=in_range)
        tl.store(input_ids_ptr + out, tl.where(real, token, root_token), mask=in_range)
        tl.store(draft_probs_ptr + out, prob, mask=in_range)
        tl.store(depths_ptr + out, tl.where(real, depth, -1), mask=in_range)
        tl.store(positions_ptr + out, prefix + tl.where(real, depth, 0), mask=in_range)
        tl.store(parents_out_ptr + out, parent, mask=in_range)
        tl.store(first_child_ptr + out, tl.where(first_child == N_PAD, -1, first_child), mask=in_range)
        tl.store(next_sibling_ptr + out, tl.where(next_sibling == N_PAD, -1, next_sibling), mask=in_range)
        tl.store(retrieve_index_ptr + out, out.to(tl.int64), mask=in_range)
        mask_offsets = b * N * N + rows[:, None] * N + columns[None, :]
        tl.store(
            tree_mask_ptr + mask_offsets,
            ancestors.to(tl.uint8),
            mask=in_range[:, None] & (columns[None, :] < N),
        )


def _check_tree_inputs(parents, ranks, topk_tokens, topk_probs, root_tokens, prefix_lens, num_nodes) -> None:
    if topk_tokens.dim() != 3 or topk_probs.shape != topk_tokens.shape:
        raise ValueError("topk_tokens and topk_probs must both be [B, N, K]")
    batch, nodes, _ = topk_tokens.shape
    for name, value in (("parents", parents), ("ranks", ranks)):
        if value.shape not in ((batch, nodes), (nodes,)):
            raise ValueError(f"{name} must be [B, N] or [N] (one topology for all requests), got {tuple(value.shape)}")
    for name, value in (("root_tokens", root_tokens), ("prefix_lens", prefix_lens), ("num_nodes", num_nodes)):
        if value.shape != (batch,):
            raise ValueError(f"{name} must be [B]={batch}, got {tuple(value.shape)}")
    for value in (parents, ranks, topk_tokens, root_tokens, prefix_lens, num_nodes):
        if value.dtype != torch.int64:
            raise ValueError("integer inputs must be int64")
    if topk_probs.dtype != torch.float32 or not topk_tokens.is_contiguous() or not topk_probs.is_contiguous():
        raise ValueError("topk_probs must be float32 and both candidate tensors contiguous")


def build_tree_metadata(
    parents: torch.Tensor,
    ranks: torch.Tensor,
    topk_tokens: torch.Tensor,
    topk_probs: torch.Tensor,
    root_tokens: torch.Tensor,
    prefix_lens: torch.Tensor,
    num_nodes: torch.Tensor,
    max_depth: int,
    out: TreeMetadata | None = None,
) -> TreeMetadata:
    """Launcher. parents / ranks: [B, N] or [N] int64; topk_tokens / topk_probs: [B, N, K]; root_tokens,
    prefix_lens, num_nodes: [B] int64. ``max_depth`` bounds the ancestor walk (>= the deepest tree).
    Writes into ``out`` when given (no allocation), else allocates."""
    _check_tree_inputs(parents, ranks, topk_tokens, topk_probs, root_tokens, prefix_lens, num_nodes)
    batch, nodes, k = topk_tokens.shape
    out = out if out is not None else TreeMetadata.empty(batch, nodes, topk_tokens.device)
    n_pad = max(triton.next_power_of_2(nodes), ROW_BLOCK)
    _tree_metadata_kernel[(batch,)](
        parents,
        0 if parents.dim() == 1 else parents.stride(0),
        ranks,
        0 if ranks.dim() == 1 else ranks.stride(0),
        topk_tokens,
        topk_probs,
        root_tokens,
        prefix_lens,
        num_nodes,
        out.tokens,
        out.input_ids,
        out.draft_probs,
        out.depths,
        out.positions,
        out.parents,
        out.first_child,
        out.next_sibling,
        out.retrieve_index,
        out.tree_mask,
        N=nodes,
        K=k,
        N_PAD=n_pad,
        MAX_DEPTH=max_depth,
        ROWS=ROW_BLOCK,
    )
    return out


def build_tree_metadata_reference(
    parents: torch.Tensor,
    ranks: torch.Tensor,
    topk_tokens: torch.Tensor,
    topk_probs: torch.Tensor,
    root_tokens: torch.Tensor,
    prefix_lens: torch.Tensor,
    num_nodes: torch.Tensor,
    max_depth: int,
    out: TreeMetadata | None = None,
) -> TreeMetadata:
    """Pure-torch reference with the launcher's signature: the candidates' tokens and probabilities gathered per
    node, then depths, links and the mask from ``TreeBatch`` (whose ancestor walk is unbounded; ``max_depth`` only
    bounds the kernel's, and must be at least the deepest tree)."""
    _check_tree_inputs(parents, ranks, topk_tokens, topk_probs, root_tokens, prefix_lens, num_nodes)
    batch, nodes, _ = topk_tokens.shape
    parents = parents.expand(batch, nodes)
    ranks = ranks.expand(batch, nodes)
    node = torch.arange(nodes, device=parents.device)
    real = node[None, :] < num_nodes[:, None]
    drafted = real & (node[None, :] > 0)
    candidate = (parents.clamp(min=0) * topk_tokens.shape[2] + ranks).where(drafted, 0)
    draft_tokens = torch.gather(topk_tokens.reshape(batch, -1), 1, candidate)
    draft_probs = torch.gather(topk_probs.reshape(batch, -1), 1, candidate)
    root = node[None, :] == 0
    tokens = torch.where(root, root_tokens[:, None], draft_tokens)
    trees = TreeBatch.from_parents(tokens, parents, num_nodes)
    result = TreeMetadata(
        tokens=trees.tokens,
        input_ids=torch.where(real, trees.tokens, root_tokens[:, None]).reshape(-1),
        draft_probs=torch.where(drafted, draft_probs, torch.where(real & root, 1.0, 0.0)),
        depths=trees.depths,
        positions=(prefix_lens[:, None] + trees.depths.clamp(min=0)).reshape(-1),
        parents=trees.parents,
        first_child=trees.first_child,
        next_sibling=trees.next_sibling,
        retrieve_index=(torch.arange(batch, device=node.device)[:, None] * nodes + node).to(torch.int64),
        tree_mask=trees.ancestor_mask().to(torch.uint8),
    )
    out = out if out is not None else TreeMetadata.empty(batch, nodes, topk_tokens.device)
    for field in fields(TreeMetadata):
        getattr(out, field.name).copy_(getattr(result, field.name))
    return out


@triton.jit
def _flashinfer_indptr_kernel(
    prefix_lens_ptr,  # [B] int64
    qo_indptr_ptr,  # out [B + 1] int32
    kv_indptr_ptr,  # out [B + 1] int32
    last_page_len_ptr,  # out [B] int32
    mask_indptr_ptr,  # out [B + 1] int32
    B,
    N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    B_PAD: tl.constexpr,
):
    # a single program: prefix sums over the batch
    requests = tl.arange(0, B_PAD)
    real = requests < B
    kv_len = tl.where(real, tl.load(prefix_lens_ptr + requests, mask=real, other=0) + N, 0)
    pages = (kv_len + PAGE_SIZE - 1) // PAGE_SIZE
    mask_bytes = (kv_len * N + 7) // 8
    tl.store(qo_indptr_ptr + 1 + requests, ((requests + 1) * N).to(tl.int32), mask=real)
    tl.store(kv_indptr_ptr + 1 + requests, tl.cumsum(pages, axis=0).to(tl.int32), mask=real)
    tl.store(last_page_len_ptr + requests, (kv_len - (pages - 1) * PAGE_SIZE).to(tl.int32), mask=real)
    tl.store(mask_indptr_ptr + 1 + requests, tl.cumsum(mask_bytes, axis=0).to(tl.int32), mask=real)
    tl.store(qo_indptr_ptr, 0)
    tl.store(kv_indptr_ptr, 0)
    tl.store(mask_indptr_ptr, 0)


def flashinfer_indptrs(
    prefix_lens: torch.Tensor, num_nodes: int, page_size: int = 1, out: FlashInferIndptrs | None = None
) -> FlashInferIndptrs:
    """Launcher. prefix_lens: [B] int64; every request has ``num_nodes`` query rows (static shape)."""
    if prefix_lens.dim() != 1 or prefix_lens.dtype != torch.int64:
        raise ValueError("prefix_lens must be a [B] int64 tensor")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    batch = prefix_lens.shape[0]
    out = out if out is not None else FlashInferIndptrs.empty(batch, prefix_lens.device)
    _flashinfer_indptr_kernel[(1,)](
        prefix_lens,
        out.qo_indptr,
        out.paged_kv_indptr,
        out.paged_kv_last_page_len,
        out.packed_mask_indptr,
        batch,
        N=num_nodes,
        PAGE_SIZE=page_size,
        B_PAD=max(triton.next_power_of_2(batch), 2),
    )
    return out


def flashinfer_indptrs_reference(
    prefix_lens: torch.Tensor, num_nodes: int, page_size: int = 1, out: FlashInferIndptrs | None = None
) -> FlashInferIndptrs:
    """``tree.batch.plan_indptrs`` with every request's ``num_nodes`` query rows, copied into ``out``."""
    batch = prefix_lens.shape[0]
    result = plan_indptrs([num_nodes] * batch, prefix_lens, page_size)
    out = out if out is not None else FlashInferIndptrs.empty(batch, prefix_lens.device)
    for field in fields(FlashInferIndptrs):
        getattr(out, field.name).copy_(getattr(result, field.name))
    return out


@triton.jit
def _pack_flashinfer_mask_kernel(
    tree_mask_ptr,  # [B, N, N] uint8 ancestor-or-self mask
    prefix_lens_ptr,  # [B] int64
    mask_indptr_ptr,  # [B + 1] int32 byte offset of each request's packed block
    packed_ptr,  # out [capacity] uint8
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    # program (b, chunk) packs bytes chunk*BLOCK, chunk*BLOCK + NUM_CHUNKS*BLOCK, ... of request b's block
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    prefix = tl.load(prefix_lens_ptr + b)
    kv_len = prefix + N
    num_bits = kv_len * N
    num_bytes = (num_bits + 7) // 8
    start = tl.load(mask_indptr_ptr + b).to(tl.int64)
    for first_byte in range(chunk * BLOCK, num_bytes, NUM_CHUNKS * BLOCK):
        byte = first_byte + tl.arange(0, BLOCK)
        packed = tl.zeros([BLOCK], dtype=tl.int32)
        for bit in tl.static_range(8):
            position = byte * 8 + bit
            inside = position < num_bits
            row = position // kv_len
            column = position % kv_len
            in_tree = column >= prefix
            tree_bit = tl.load(
                tree_mask_ptr + b * N * N + row * N + (column - prefix), mask=inside & in_tree, other=0
            ).to(tl.int32)
            value = tl.where(in_tree, tree_bit, 1) * inside.to(tl.int32)
            packed = packed | (value << bit)
        tl.store(packed_ptr + start + byte, packed.to(tl.uint8), mask=byte < num_bytes)


def pack_flashinfer_mask(
    tree_mask: torch.Tensor,
    prefix_lens: torch.Tensor,
    packed_mask_indptr: torch.Tensor,
    out: torch.Tensor,
    block: int = 128,
    num_chunks: int = 4,
) -> torch.Tensor:
    """Launcher. tree_mask: [B, N, N] uint8; prefix_lens: [B] int64; packed_mask_indptr: [B + 1] int32 from
    ``flashinfer_indptrs``; out: uint8 buffer with room for packed_mask_indptr[-1] bytes (preallocated for the
    longest context, since the size is data-dependent)."""
    if tree_mask.dim() != 3 or tree_mask.dtype != torch.uint8 or tree_mask.shape[1] != tree_mask.shape[2]:
        raise ValueError("tree_mask must be a [B, N, N] uint8 tensor")
    if out.dtype != torch.uint8 or out.dim() != 1:
        raise ValueError("out must be a 1-D uint8 buffer")
    batch, nodes, _ = tree_mask.shape
    _pack_flashinfer_mask_kernel[(batch, num_chunks)](
        tree_mask, prefix_lens, packed_mask_indptr, out, N=nodes, BLOCK=block, NUM_CHUNKS=num_chunks
    )
    return out


def pack_flashinfer_mask_reference(
    tree_mask: torch.Tensor,
    prefix_lens: torch.Tensor,
    packed_mask_indptr: torch.Tensor,
    out: torch.Tensor,
    block: int = 128,
    num_chunks: int = 4,
) -> torch.Tensor:
    """Each request's N x (prefix + N) rows (``tree.batch.with_prefix``) packed like ``segment_packbits``."""
    for b in range(tree_mask.shape[0]):
        packed = pack_bits_little_endian(with_prefix(tree_mask[b].cpu(), int(prefix_lens[b])).reshape(-1))
        start = int(packed_mask_indptr[b])
        out[start : start + packed.numel()] = packed.to(out.device)
    return out


@triton.jit
def _parents_from_links_kernel(
    first_child_ptr,  # [B, N] int64 first child per node, -1 when none
    next_sibling_ptr,  # [B, N] int64 next sibling per node, -1 when none
    parents_ptr,  # out [B, N] int64, -1 for the root and for nodes no link reaches
    N: tl.constexpr,
    N_PAD: tl.constexpr,
):
    # one program per request: every node's children chain (first child, then siblings) names it as parent
    b = tl.program_id(0)
    nodes = tl.arange(0, N_PAD)
    tl.store(parents_ptr + b * N + nodes, tl.full([N_PAD], -1, dtype=tl.int64), mask=nodes < N)
    for node in range(N):
        child = tl.load(first_child_ptr + b * N + node)
        hops = 0
        while (child >= 0) & (hops < N):  # a malformed cycle cannot spin
            tl.store(parents_ptr + b * N + child, node)
            child = tl.load(next_sibling_ptr + b * N + child)
            hops += 1


def parents_from_links(first_child: torch.Tensor, next_sibling: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher. first_child / next_sibling [B, N] int64 (local ids, -1 = none) -> parents [B, N] int64."""
    if first_child.shape != next_sibling.shape or first_child.dim() != 2:
        raise ValueError("first_child and next_sibling must both be [B, N]")
    batch, nodes = first_child.shape
    out = out if out is not None else torch.empty_like(first_child)
    _parents_from_links_kernel[(batch,)](first_child, next_sibling, out, N=nodes,
                                         N_PAD=max(triton.next_power_of_2(nodes), 2))
    return out


def parents_from_links_reference(first_child: torch.Tensor, next_sibling: torch.Tensor,
                                 out: torch.Tensor | None = None) -> torch.Tensor:
    if first_child.shape != next_sibling.shape or first_child.dim() != 2:
        raise ValueError("first_child and next_sibling must both be [B, N]")
    parents = torch.full(first_child.shape, -1, dtype=torch.int64)
    first, sibling = first_child.cpu().tolist(), next_sibling.cpu().tolist()
    for b, (row_first, row_sibling) in enumerate(zip(first, sibling)):
        for node, child in enumerate(row_first):
            hops = 0
            while child >= 0 and hops < len(row_first):
                parents[b, child] = node
                child, hops = row_sibling[child], hops + 1
    out = out if out is not None else torch.empty_like(first_child)
    return out.copy_(parents)
