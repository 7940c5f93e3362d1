"""Boolean attention masks (True = attend) in the format a transformers attention implementation expects."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def attention_mask_for(config: PretrainedConfig, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """allowed: [B, 1, Q, K] bool. SDPA-style implementations take it as is; eager attention adds the mask to
    the scores, so it gets 0 where allowed and the dtype's minimum elsewhere."""
    if getattr(config, "_attn_implementation", "sdpa") == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )
    return allowed
