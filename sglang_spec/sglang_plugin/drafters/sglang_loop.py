"""``SGLangLoopDrafter``: chain and eagle trees, drafted by SGLang's own EAGLE loop, with one change: each beam keeps
its own KV ancestry. SGLang re-chooses its W beams every step, so a beam whose parent was another beam would read
that beam's history; after each of SGLang's selections (``spec_utils.select_top_k_tokens``, hooked) every new
beam's KV column takes its parent beam's history (``beams.permute_kv``), so every node attends to its own
ancestors only, as the reference decoder's drafts do.
"""

from __future__ import annotations

import torch

from sglang_spec.sglang_plugin.drafters.base import DraftCall, SGLangDraft, ServedDrafter
from sglang_spec.sglang_plugin.drafters.beam_selection import ancestry_permutation
from sglang_spec.sglang_plugin.drafters.beams import permute_kv
from sglang_spec.sglang_plugin.state import SGLANG_LOOP_STEP, SGLangLoopStep


class SGLangLoopDrafter(ServedDrafter):
    """chain / eagle. ``width``, ``steps``: SGLang's draft shape."""

    def __init__(self, width: int, steps: int) -> None:
        self.width = width
        self.steps = steps

    def draft(self, call: DraftCall) -> SGLangDraft:
        from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc

        forward_batch = call.forward_batch
        step_locs = per_step_draft_out_cache_loc(forward_batch.out_cache_loc, forward_batch.batch_size, self.width,
                                                 self.steps)
        token = SGLANG_LOOP_STEP.set(SGLangLoopStep(step_locs, call.worker.draft_runner.token_to_kv_pool, self.steps,
                                                    self.exact_ancestry))
        try:
            return call.sglang_loop()
        finally:
            SGLANG_LOOP_STEP.reset(token)


def keep_ancestry(step: SGLangLoopStep, level: int, selected_parents: torch.Tensor, topk: int) -> None:
    """After SGLang's selection at draft level ``level`` >= 1 (``selected_parents``: the new beams' parent slots
    [bs, W], SGLang's candidate-slot ids): every new beam's KV column takes its parent beam's history. The last
    selection runs no further forward, and level 0's beams are the root's children (no history to copy)."""
    if level == 0 or not step.exact_ancestry or level >= step.steps - 1:
        return
    parent_beam = torch.div(selected_parents - (topk * topk * (level - 1) + topk), topk, rounding_mode="floor")
    target, source = ancestry_permutation(parent_beam, step.step_locs, level)
    permute_kv(step.pool, target, source)
