"""Tree attention for FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper.plan(..., custom_mask=...)``.

Each request's queries are its tree nodes; its keys are the verified prefix followed by the tree nodes. Row r of a
request's mask is True on every prefix column and on the tree columns of node r's ancestors, itself and the root.
``plan()`` flattens each request's ``q_len x kv_len`` block row-major, concatenates the blocks and packs them with
``segment_packbits(mask, indptr, bitorder="little")``: every block padded to whole bytes on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_spec.errors import SpecError
from sglang_spec.tree.bits import pack_bits_little_endian
from sglang_spec.tree.token_tree import TokenTree


@dataclass(frozen=True, eq=False)
class FlashInferTreeMask:
    """Everything plan() needs for tree verify of B requests (q_b = tree nodes, kv_b = prefix_b + q_b).

    Fields:
      qo_indptr:          [B + 1] int32. Cumulative q_b.
      paged_kv_indptr:    [B + 1] int32. Cumulative pages per request, ceil(kv_b / page_size).
      paged_kv_last_page_len: [B] int32. Tokens in each request's last page (page_size when full).
      custom_mask:        [sum q_b * kv_b] bool. Row-major blocks, concatenated.
      mask_indptr:        [B + 1] int32. Element offsets of the blocks in ``custom_mask``.
      packed_mask:        [sum ceil(q_b * kv_b / 8)] uint8. Each block packed little-endian (bit j of byte i =
                          element 8 i + j of the block), padded to a whole byte.
      packed_mask_indptr: [B + 1] int32. Byte offsets of the packed blocks (plan()'s ``mask_indptr``).
    A padded request (``None`` tree) has q_b = 0 and an empty block.
    """

    qo_indptr: torch.Tensor
    paged_kv_indptr: torch.Tensor
    paged_kv_last_page_len: torch.Tensor
    custom_mask: torch.Tensor
    mask_indptr: torch.Tensor
    packed_mask: torch.Tensor
    packed_mask_indptr: torch.Tensor


def encode_flashinfer_mask(
    trees: Sequence[TokenTree | None], prefix_lens: Sequence[int] | torch.Tensor, page_size: int = 1
) -> FlashInferTreeMask:
    """Builds the custom mask and indptrs for a batch of trees of any sizes (``None`` = padded request)."""
    prefix_lens = [int(length) for length in torch.as_tensor(prefix_lens).reshape(-1).tolist()]
    if len(prefix_lens) != len(trees):
        raise SpecError(f"got {len(prefix_lens)} prefix lengths for {len(trees)} trees")
    if page_size < 1:
        raise SpecError(f"page_size must be >= 1, got {page_size}")
    if any(length < 0 for length in prefix_lens):
        raise SpecError("prefix lengths must be >= 0")
    q_lens, kv_lens, blocks = [], [], []
    for tree, prefix in zip(trees, prefix_lens):
        if tree is None:
            q_lens.append(0)
            kv_lens.append(prefix)
            blocks.append(torch.zeros(0, dtype=torch.bool))
            continue
        mask = tree.ancestor_mask()
        q_lens.append(tree.num_nodes)
        kv_lens.append(prefix + tree.num_nodes)
        blocks.append(torch.cat([torch.ones(tree.num_nodes, prefix, dtype=torch.bool), mask], dim=1).reshape(-1))
    pages = [(length + page_size - 1) // page_size for length in kv_lens]
    last_page = [length - (count - 1) * page_size if count > 0 else 0 for length, count in zip(kv_lens, pages)]
    return FlashInferTreeMask(
        qo_indptr=_indptr(q_lens),
        paged_kv_indptr=_indptr(pages),
        paged_kv_last_page_len=torch.tensor(last_page, dtype=torch.int32),
        custom_mask=torch.cat(blocks),
        mask_indptr=_indptr([block.numel() for block in blocks]),
        packed_mask=torch.cat([pack_bits_little_endian(block) for block in blocks]),
        packed_mask_indptr=_indptr([(block.numel() + 7) // 8 for block in blocks]),
    )


def _indptr(lengths: Sequence[int]) -> torch.Tensor:
    indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        indptr[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
    return indptr
