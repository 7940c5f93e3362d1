"""``HeadLoopDrafter``: sequoia and specexec trees, drafted by the plugin's own loop in place of SGLang's
``EagleDraftWorker.draft_forward`` (eagle and chain keep SGLang's loop: ``sglang_loop``).

Per step it runs SGLang's draft model on the W beams exactly as SGLang's loop does (same attention backends,
same per-step KV slots, same hot-token map, same softmax: ``beams.forward_beams``), and does the rest with
``beam_selection.DraftLoop``:
each node keeps its top-K candidates as children, the next beams are chosen by the policy, and before a beam
is forwarded its KV column is overwritten with its parent's, so every node attends to its own ancestors only.

Only the beams that can grow (``DraftLoop.live``: at step 1 the root's K candidates, then the plan's expanded
nodes or SpecExec's growable ranks) get the head's logits: the draft model's layers run over the W beams SGLang's
attention metadata holds, and its logits processor over the live rows only (``state.LOGIT_ROWS``, read by the hook on
``LogitsMetadata.from_forward_batch`` through SGLang's own row selection), the larger part of a draft forward's
cost where the head projects onto the vocabulary. Everything is device tensor code with the shapes fixed by
(batch, W, steps, live): nothing is read on the host and nothing copied from it, so SGLang's draft CUDA graph can
capture the loop.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_spec.sglang_plugin.drafters.base import DraftCall, SGLangDraft, ServedDrafter
from sglang_spec.sglang_plugin.drafters.beam_selection import DraftLoop, Level, ancestry_permutation
from sglang_spec.sglang_plugin.drafters.beams import forward_beams, permute_kv
from sglang_spec.sglang_plugin.drafters.head_guard import HeadGuard, finite_rows


class HeadLoopDrafter(ServedDrafter):
    """sequoia / specexec: the plugin's device loop (``loop``), graph-capturable; ``guard``: a request drafted from
    a non-finite head output verifies the filler tree."""

    def __init__(self, loop: DraftLoop, guard: HeadGuard) -> None:
        self.loop = loop
        self.guard = guard

    def draft(self, call: DraftCall) -> SGLangDraft:
        return draft_forward(call.worker, call.forward_batch, self.loop, self.guard)


def draft_forward(worker: Any, forward_batch: Any, loop: DraftLoop, guard: HeadGuard | None = None) -> SGLangDraft:
    """``draft_forward`` for ``worker`` (an EagleDraftWorker): SGLang's (parent_list, top_scores_index,
    draft_tokens, draft_probs) with draft_probs None (greedy and target-only sampling verify never read them).
    With ``guard`` a request whose head probabilities are not all finite verifies the filler tree
    (``head_guard``)."""
    from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc

    spec_info = forward_batch.spec_info
    batch = forward_batch.batch_size
    width = loop.width
    topk_index = spec_info.topk_index
    if worker.hot_token_id is not None:
        topk_index = worker.hot_token_id[topk_index]
    step_locs = per_step_draft_out_cache_loc(forward_batch.out_cache_loc, batch, width, loop.steps)
    pool = worker.draft_runner.token_to_kv_pool
    level = loop.root_level(spec_info.topk_p, topk_index)
    finite = finite_rows(spec_info.topk_p, batch)
    levels: list[Level] = [level]
    hidden = spec_info.hidden_states.repeat_interleave(width, dim=0)  # [b * W, H], the root's state per beam
    requests = torch.arange(batch, device=hidden.device)[:, None]
    for step in range(1, loop.steps):
        live = loop.live[step - 1]
        rows = None if live == width else (requests * width + torch.arange(live, device=hidden.device)).reshape(-1)
        output, topk_p, topk_index = forward_beams(worker, forward_batch, step, level.beam_tokens, hidden,
                                                   step_locs[step - 1], loop.children, rows)
        finite &= finite_rows(topk_p, batch)
        level = loop.next_level(step, level.beam_scores, *loop.candidate_grid(step, topk_p, topk_index, batch))
        levels.append(level)
        if step < loop.steps - 1:  # the last level is never forwarded: no state or history to carry
            # a beam's parent is live (or the beam is dead, its state unread): states of the live rows only
            states_per_request = output.hidden_states.shape[0] // batch
            parents = torch.clamp(level.parent_beam, max=states_per_request - 1) + requests * states_per_request
            hidden = output.hidden_states[parents.reshape(-1)]
            target, source = ancestry_permutation(level.parent_beam, step_locs, step)
            permute_kv(pool, target, source)
    parent_list, top_scores_index, draft_tokens = loop.organize(levels, worker.speculative_num_draft_tokens - 1)
    if guard is not None:
        parent_list, top_scores_index, draft_tokens = guard.select(finite, parent_list, top_scores_index,
                                                                   draft_tokens)
    return parent_list, top_scores_index, draft_tokens, None
