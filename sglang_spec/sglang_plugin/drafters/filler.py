"""The filler tree: what a batch verifies when its draft cannot be trusted (a draft fault, a non-finite head
output). A root and filler tokens in the server's draft shape, proposed by no head and no context: deterministic,
so verification stays exact and the step emits the target's own token (and, rarely, a filler that happens to
match).
"""

from __future__ import annotations

import torch

from sglang_spec.sglang_plugin.drafters.base import SGLangDraft
from sglang_spec.sglang_plugin.drafters.padding import pad_to_budget
from sglang_spec.tree.encode_sglang import SGLangDraftEncoding, encode_sglang_draft
from sglang_spec.tree.token_tree import TokenTree


def filler_encoding(budget: int, width: int, steps: int) -> SGLangDraftEncoding:
    """The filler tree of ``budget`` draft nodes in SGLang's draft shape (``width`` beams, ``steps`` draft steps),
    one request's rows (host tensors)."""
    root = TokenTree.from_parents([-1], tokens=[0])
    return encode_sglang_draft([pad_to_budget(root, budget, width, steps)], width, steps)


def filler_draft(filler: SGLangDraftEncoding, batch_size: int, device: torch.device | str) -> SGLangDraft:
    """SGLang's draft outputs with every one of ``batch_size`` requests verifying ``filler``."""

    def per_request(part: torch.Tensor) -> torch.Tensor:
        return part.to(device).expand(batch_size, -1).contiguous()

    return (per_request(filler.parent_list), per_request(filler.top_scores_index), per_request(filler.draft_tokens),
            None)
