"""What verifying a batch of trees produces."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_spec.tree.batch import TreeBatch


@dataclass(frozen=True, eq=False)
class VerifyResult:
    """Accepted path per request (D = the batch's maximum tree depth).

    Fields:
      accepted_nodes: [B, D + 1] int64. Node ids on the accepted path, root first; entries past accept_length are
                      -1, and a padded request's row is all -1.
      accept_length:  [B] int64. Accepted draft tokens + 1 (the bonus token); 0 for a padded request.
      bonus_token:    [B] int64. Token emitted after the deepest accepted node; -1 for a padded request.
      output_tokens:  [B, D + 1] int64. Emitted tokens in order: the accepted draft tokens, then the bonus token;
                      -1 past accept_length.
    """

    accepted_nodes: torch.Tensor
    accept_length: torch.Tensor
    bonus_token: torch.Tensor
    output_tokens: torch.Tensor

    def tokens(self, request: int) -> list[int]:
        """Emitted tokens of one request as a list."""
        return self.output_tokens[request, : int(self.accept_length[request])].tolist()


def finish(batch: TreeBatch, accepted_nodes: torch.Tensor, bonus_token: torch.Tensor) -> VerifyResult:
    """Fills accept_length and output_tokens from the accepted path and the bonus token."""
    real = batch.num_nodes > 0
    accept_length = (accepted_nodes >= 0).sum(-1)
    bonus_token = torch.where(real, bonus_token, torch.full_like(bonus_token, -1))
    path_tokens = torch.gather(batch.tokens, 1, accepted_nodes.clamp(min=0))
    # output j is the token of path node j + 1 while j + 1 < accept_length, then the bonus
    shifted = torch.cat([path_tokens[:, 1:], torch.full_like(path_tokens[:, :1], -1)], dim=1)
    column = torch.arange(accepted_nodes.shape[1], device=accepted_nodes.device)[None, :]
    output = torch.where(column < (accept_length - 1)[:, None], shifted, torch.full_like(shifted, -1))
    output = torch.where(column == (accept_length - 1)[:, None], bonus_token[:, None], output)
    return VerifyResult(accepted_nodes, accept_length, bonus_token, output)
