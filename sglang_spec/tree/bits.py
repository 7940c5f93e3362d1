"""Little-endian bit packing shared by the FlashInfer and SGLang mask encoders."""

from __future__ import annotations

import torch


def pack_bits_little_endian(bits: torch.Tensor) -> torch.Tensor:
    """[L] bool -> [ceil(L / 8)] uint8; bit j of byte i = bits[8 i + j] (numpy.packbits(..., bitorder="little"))."""
    length = bits.numel()
    padded = torch.zeros((length + 7) // 8 * 8, dtype=torch.int32)
    padded[:length] = bits.reshape(-1).to(torch.int32)
    weights = 2 ** torch.arange(8, dtype=torch.int32)
    return (padded.reshape(-1, 8) * weights).sum(-1).to(torch.uint8)
