"""The accept epilogue that runs inside SGLang's captured target-verify graph (``capture_tail_hooks``).

During capture and every replay it runs our fused kernels (``kernels/verify_accept.py``) on the verify logits
into static buffers, so no accept work is left for the eager path and nothing reads the host. ``sglang_outputs``
turns the result into exactly what SGLang's ``eagle_sample`` returns for greedy requests:
``predict [bs*n] int32`` (token emitted at each accepted node's global id), ``num_correct_drafts [bs] int32`` and
``accept_index [bs, max_tree_depth] int32`` (global node ids, -1 padded).

Only plain greedy batches may use it: eagle_sample applies penalties, logit bias, grammar masks and watermarks
to the logits first, and the plugin falls back to SGLang's own path whenever any of those is present.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang_spec.kernels.verify_accept import AcceptOutputs


@dataclass(frozen=True, eq=False)
class StaticAccept:
    """Static buffers for one captured batch size (B requests x N tree tokens)."""

    target: torch.Tensor  # [B * N] int64
    output_ids: torch.Tensor  # [B, depth + 1] int64 scratch output buffer
    output_lens: torch.Tensor  # [B] int64
    accept: AcceptOutputs
    predict_with_spare: torch.Tensor  # [B * N + 1] int32; the last slot absorbs writes for padded path entries
    num_correct_drafts: torch.Tensor  # [B] int32
    accept_index: torch.Tensor  # [B, depth + 1] int32

    @property
    def predict(self) -> torch.Tensor:
        """[B * N] int32, eagle_sample's ``predict``."""
        return self.predict_with_spare[:-1]


class AcceptEpilogue:
    def __init__(self, num_tokens_per_request: int, max_depth: int) -> None:
        self.nodes = num_tokens_per_request
        self.max_depth = max_depth
        self.static: dict[int, StaticAccept] = {}

    def buffers(self, batch_size: int, device: torch.device) -> StaticAccept:
        from sglang_spec.kernels.verify_accept import AcceptOutputs

        if batch_size not in self.static:
            depth = self.max_depth
            self.static[batch_size] = StaticAccept(
                target=torch.zeros(batch_size * self.nodes, dtype=torch.int64, device=device),
                output_ids=torch.zeros(batch_size, depth + 1, dtype=torch.int64, device=device),
                output_lens=torch.zeros(batch_size, dtype=torch.int64, device=device),
                accept=AcceptOutputs.empty(batch_size, depth, device),
                predict_with_spare=torch.zeros(batch_size * self.nodes + 1, dtype=torch.int32, device=device),
                num_correct_drafts=torch.zeros(batch_size, dtype=torch.int32, device=device),
                accept_index=torch.full((batch_size, depth + 1), -1, dtype=torch.int32, device=device),
            )
        return self.static[batch_size]

    def run(self, logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor) -> StaticAccept:
        """logits [B*N, V]; tokens / parents [B, N] int64 (SGLang's candidates and the tree's parents); num_nodes
        [B]. Greedy accept into the static buffers of this batch size, then SGLang's output format."""
        from sglang_spec.kernels.verify_accept import MatchMode, accept_walk, target_tokens

        batch = tokens.shape[0]
        static = self.buffers(batch, logits.device)
        zeros = torch.zeros(batch, device=logits.device)
        target_tokens(logits, self.nodes, zeros, zeros.long(), zeros + 1, zeros.repeat_interleave(self.nodes),
                      False, out=static.target)
        static.output_lens.zero_()
        accept_walk(tokens, parents, num_nodes, self.max_depth, static.output_ids, static.output_lens,
                    MatchMode(static.target), out=static.accept)
        self._to_sglang(static, batch)
        return static

    def _to_sglang(self, static: StaticAccept, batch: int) -> None:
        accept = static.accept
        base = (torch.arange(batch, device=accept.accepted_nodes.device) * self.nodes)[:, None]
        accepted = accept.accepted_nodes
        global_ids = torch.where(accepted >= 0, accepted + base, torch.full_like(accepted, -1))
        static.accept_index.copy_(global_ids.to(torch.int32))
        static.num_correct_drafts.copy_((accept.accept_length - 1).clamp(min=0).to(torch.int32))
        # predict[global id of path node j] = the token emitted after it (next accepted draft, or the bonus)
        # (padded entries go to the spare slot: a boolean-mask scatter would read the mask on the host)
        spare = torch.full_like(global_ids, batch * self.nodes)
        index = torch.where(accepted >= 0, global_ids, spare).reshape(-1)
        static.predict_with_spare.zero_()
        static.predict_with_spare.scatter_(0, index, static.output_ids.reshape(-1).to(torch.int32))
