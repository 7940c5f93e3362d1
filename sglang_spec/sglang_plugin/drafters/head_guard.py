"""A non-finite MTP head output, handled where it arises: no tree is built from NaN or infinite probabilities.

The plugin's own draft loop (sequoia / specexec) may run inside SGLang's draft CUDA graph, where nothing can be read
on the host. So there each request's head probabilities (the root's top-k and every step's) are checked on the
device: a request with any non-finite value verifies the filler tree instead of its drafts (the draft-fault path's
tree: no head, so the step emits the target's own token; ``drafters.filler``), chosen per request with
``torch.where``, and a device counter counts it (``HeadGuard``). The host reads the counter outside the graph, at
most once a second on a GPU and every step on a CPU (as ``metrics.RankMetrics`` reads its counts): each new count
goes to ``sglang_spec_draft_faults_total{error="NonFiniteHeadOutput"}`` with one log line. The context drafter
(lookup / hybrid) reads the probabilities on the host anyway and raises ``NonFiniteHeadOutput`` for its batch,
which the draft-fault path counts under the same label.

Tests inject the fault through launch_server (``faults.HeadPoison``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_spec.tree.encode_sglang import SGLangDraftEncoding

ERROR = "NonFiniteHeadOutput"  # the error label of sglang_spec_draft_faults_total
READ_SECONDS = 1.0  # on a GPU the counter is read at most this often (each read waits for the device)


class NonFiniteHeadOutput(FloatingPointError):
    """The MTP head's probabilities for a batch hold a NaN or an infinity."""


def finite_rows(probs: torch.Tensor, batch: int) -> torch.Tensor:
    """[batch] bool: whether each request's rows of ``probs`` ([batch * rows, k], request-major) are all finite."""
    return torch.isfinite(probs).view(batch, -1).all(dim=-1)


@dataclass
class HeadGuard:
    """Per draft worker running the own loop: the filler tree's outputs for one request and the device counter.

    Fields:
      parent_list:      [1, topk * (steps - 1) + 1] int64, the filler's (``SGLangDraftEncoding`` documents the
                        layout and its -1 padding); top_scores_index, draft_tokens: [1, budget] int64.
      count:            [1] int64 on the draft device: requests drafted from a non-finite head output so far.
      read:             the count the host last read; last_read: when (``time.monotonic``)."""

    parent_list: torch.Tensor
    top_scores_index: torch.Tensor
    draft_tokens: torch.Tensor
    count: torch.Tensor
    read: int = 0
    last_read: float = float("-inf")

    @classmethod
    def build(cls, filler: SGLangDraftEncoding, device: torch.device | str) -> HeadGuard:
        """Before any draft graph is captured: the filler and the counter live on the device from the start."""
        return cls(parent_list=filler.parent_list.to(device), top_scores_index=filler.top_scores_index.to(device),
                   draft_tokens=filler.draft_tokens.to(device), count=torch.zeros(1, dtype=torch.int64, device=device))

    def select(self, finite: torch.Tensor, parent_list: torch.Tensor, top_scores_index: torch.Tensor,
               draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each request's drafts where ``finite`` ([b] bool), else the filler's; counts the others. Device ops
        with fixed shapes only (graph-safe)."""
        self.count.add_((~finite).sum())
        keep = finite[:, None]
        return (torch.where(keep, parent_list, self.parent_list.to(parent_list.dtype)),
                torch.where(keep, top_scores_index, self.top_scores_index.to(top_scores_index.dtype)),
                torch.where(keep, draft_tokens, self.draft_tokens.to(draft_tokens.dtype)))

    def new_faults(self, now: float) -> int:
        """Requests counted since the last read; reads the device (one wait) at most once every ``READ_SECONDS``
        on a GPU, every call on a CPU, and returns 0 when it does not read."""
        if self.count.device.type != "cpu" and now - self.last_read < READ_SECONDS:
            return 0
        self.last_read = now
        total = int(self.count.item())
        new, self.read = total - self.read, total
        return new
