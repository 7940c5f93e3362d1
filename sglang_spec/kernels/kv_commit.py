"""KV commit: move the accepted path's KV rows to the request's first tree positions, in place, and report the
tree slots that are free afterwards.

Tree node i of request b wrote its KV at slot ``tree_slots[b, i]`` (the slot of position prefix_b + i). After
verify, position prefix_b + j must hold the KV of the j-th node on the accepted path, so row
``tree_slots[b, accepted_nodes[b, j]]`` is copied to row ``tree_slots[b, j]`` for j < accept_length; slots of
positions j >= accept_length (up to the tree's node count) are reported free.

Why ascending j is safe in place: path node ids increase with depth and ``accepted_nodes[b, j] >= j``, so a copy
never reads a row that an earlier copy (a lower j) wrote. A later copy may overwrite a row an earlier copy read;
each program keeps one fixed column range for every j, so each element is read before it is overwritten, in
program order.

Layouts: a buffer is [slots, *row] (SGLang's per-layer MHA K or V [slots, heads, head_dim], or the MLA latent
[slots, 1, kv_lora_rank + rope_dim]) or [layers, slots, *row] with ``stacked=True``. Rows must be contiguous.
Paged pools: ``paged_tree_slots`` turns a page table into flat tree slots first.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl


@triton.jit
def _commit_kv_kernel(
    buffer_ptr,  # [layers, slots, row] KV rows (layer stride layer_stride, slot stride slot_stride)
    layer_stride,
    slot_stride,
    row_elements,
    tree_slots_ptr,  # [B, N] int64 slot of each tree position
    accepted_ptr,  # [B, D1] int64 accepted node ids, root first
    accept_length_ptr,  # [B] int64
    num_nodes_ptr,  # [B] int64
    freed_ptr,  # out [B, N] int64 freed slot per tree position, -1 when kept or padding
    N: tl.constexpr,
    N_PAD: tl.constexpr,
    D1: tl.constexpr,
    BLOCK: tl.constexpr,
    WRITE_FREED: tl.constexpr,
):
    # program (b, layer, chunk) moves columns [chunk*BLOCK, (chunk+1)*BLOCK) of request b's accepted rows
    b = tl.program_id(0)
    layer = tl.program_id(1)
    chunk = tl.program_id(2)
    columns = chunk * BLOCK + tl.arange(0, BLOCK)
    in_row = columns < row_elements
    length = tl.load(accept_length_ptr + b)
    base = buffer_ptr + layer.to(tl.int64) * layer_stride
    for j in range(0, length):
        node = tl.load(accepted_ptr + b * D1 + j)
        source = tl.load(tree_slots_ptr + b * N + node)
        target = tl.load(tree_slots_ptr + b * N + j)
        if source != target:
            values = tl.load(base + source * slot_stride + columns, mask=in_row)
            tl.store(base + target * slot_stride + columns, values, mask=in_row)
    if WRITE_FREED:
        if (layer == 0) & (chunk == 0):
            positions = tl.arange(0, N_PAD)
            count = tl.load(num_nodes_ptr + b)
            slots = tl.load(tree_slots_ptr + b * N + positions, mask=positions < N, other=-1)
            free = (positions >= length) & (positions < count)
            tl.store(freed_ptr + b * N + positions, tl.where(free, slots, -1), mask=positions < N)


def _as_layers(buffer: torch.Tensor, stacked: bool) -> tuple[int, int, int, int]:
    """(layers, layer_stride, slot_stride, row_elements) of a [slots, *row] or [layers, slots, *row] buffer."""
    slot_dim = 1 if stacked else 0
    if buffer.dim() < slot_dim + 1:
        raise ValueError(f"a KV buffer needs a slot dimension, got shape {tuple(buffer.shape)}")
    row_shape = buffer.shape[slot_dim + 1 :]
    row_elements = 1
    for size in row_shape:
        row_elements *= size
    expected_stride = 1
    for size, stride in zip(reversed(row_shape), reversed(buffer.stride()[slot_dim + 1 :])):
        if size > 1 and stride != expected_stride:
            raise ValueError("KV rows must be contiguous (NHD layout)")
        expected_stride *= size
    layers = buffer.shape[0] if stacked else 1
    layer_stride = buffer.stride(0) if stacked else 0
    return layers, layer_stride, buffer.stride(slot_dim), row_elements


def commit_kv(
    buffers: Sequence[torch.Tensor],
    tree_slots: torch.Tensor,
    accepted_nodes: torch.Tensor,
    accept_length: torch.Tensor,
    num_nodes: torch.Tensor,
    freed_slots: torch.Tensor,
    stacked: bool = False,
    block: int = 256,
) -> torch.Tensor:
    """Launcher: one launch per buffer (each [slots, *row], or [layers, slots, *row] with ``stacked``).
    tree_slots [B, N], accepted_nodes [B, D + 1], accept_length [B], num_nodes [B]: int64. Writes
    ``freed_slots`` [B, N] (slot when free, else -1) and returns it."""
    batch, nodes = tree_slots.shape
    if freed_slots.shape != (batch, nodes):
        raise ValueError(f"freed_slots must be [B, N] = [{batch}, {nodes}]")
    for index, buffer in enumerate(buffers):
        layers, layer_stride, slot_stride, row_elements = _as_layers(buffer, stacked)
        block_size = min(block, triton.next_power_of_2(row_elements))
        grid = (batch, layers, triton.cdiv(row_elements, block_size))
        _commit_kv_kernel[grid](
            buffer,
            layer_stride,
            slot_stride,
            row_elements,
            tree_slots,
            accepted_nodes,
            accept_length,
            num_nodes,
            freed_slots,
            N=nodes,
            N_PAD=max(triton.next_power_of_2(nodes), 2),
            D1=accepted_nodes.shape[1],
            BLOCK=block_size,
            WRITE_FREED=index == 0,
        )
    if not buffers:
        freed_slots.copy_(_freed_reference(tree_slots, accept_length, num_nodes))
    return freed_slots


def _freed_reference(tree_slots: torch.Tensor, accept_length: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tree_slots.shape[1], device=tree_slots.device)[None, :]
    free = (positions >= accept_length[:, None]) & (positions < num_nodes[:, None])
    return torch.where(free, tree_slots, torch.full_like(tree_slots, -1))


def commit_kv_reference(
    buffers: Sequence[torch.Tensor],
    tree_slots: torch.Tensor,
    accepted_nodes: torch.Tensor,
    accept_length: torch.Tensor,
    num_nodes: torch.Tensor,
    freed_slots: torch.Tensor,
    stacked: bool = False,
    block: int = 256,
) -> torch.Tensor:
    """Row copies in ascending path order, one request at a time."""
    for buffer in buffers:
        for b in range(tree_slots.shape[0]):
            for j in range(int(accept_length[b])):
                source = int(tree_slots[b, int(accepted_nodes[b, j])])
                target = int(tree_slots[b, j])
                if stacked:
                    buffer[:, target] = buffer[:, source]
                else:
                    buffer[target] = buffer[source]
    return freed_slots.copy_(_freed_reference(tree_slots, accept_length, num_nodes))


@triton.jit
def _paged_tree_slots_kernel(
    page_table_ptr,  # [B, max_pages] int64 page id per logical page (row stride page_table_stride)
    page_table_stride,
    prefix_lens_ptr,  # [B] int64
    tree_slots_ptr,  # out [B, N] int64
    N: tl.constexpr,
    N_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    b = tl.program_id(0)
    nodes = tl.arange(0, N_PAD)
    position = tl.load(prefix_lens_ptr + b) + nodes
    page = tl.load(page_table_ptr + b * page_table_stride + position // PAGE_SIZE, mask=nodes < N, other=0)
    tl.store(tree_slots_ptr + b * N + nodes, page * PAGE_SIZE + position % PAGE_SIZE, mask=nodes < N)


def paged_tree_slots(
    page_table: torch.Tensor, prefix_lens: torch.Tensor, num_nodes: int, page_size: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Launcher: slot of tree position i of request b = page_table[b, (prefix + i) // P] * P + (prefix + i) % P."""
    batch = prefix_lens.shape[0]
    out = out if out is not None else torch.empty(batch, num_nodes, dtype=torch.int64, device=prefix_lens.device)
    _paged_tree_slots_kernel[(batch,)](
        page_table,
        page_table.stride(0),
        prefix_lens,
        out,
        N=num_nodes,
        N_PAD=max(triton.next_power_of_2(num_nodes), 2),
        PAGE_SIZE=page_size,
    )
    return out


def paged_tree_slots_reference(
    page_table: torch.Tensor, prefix_lens: torch.Tensor, num_nodes: int, page_size: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    position = prefix_lens[:, None] + torch.arange(num_nodes, device=prefix_lens.device)[None, :]
    page = torch.gather(page_table, 1, position // page_size)
    result = page * page_size + position % page_size
    return result if out is None else out.copy_(result)
