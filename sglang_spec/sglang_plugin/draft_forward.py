"""The plugin's own ``draft_forward`` for SGLang's EAGLE v2 worker (``EagleDraftWorker.draft_forward`` replaced
when the tree policy is sequoia or specexec; eagle and chain keep SGLang's loop).

Per step it runs SGLang's draft model on the W beams exactly as SGLang's loop does (same attention backends,
same per-step KV slots, same hot-token map, same softmax), and does the rest with ``draft_loop.DraftLoop``:
each node keeps its top-K candidates as children, the next beams are chosen by the policy, and before a beam
is forwarded its KV column is overwritten with its parent's, so every node attends to its own ancestors only.

Only the beams that can grow (``DraftLoop.live``: at step 1 the root's K candidates, then the plan's expanded
nodes or SpecExec's growable ranks) get the head's logits: the draft model's layers run over the W beams SGLang's
attention metadata holds, and its logits processor over the live rows only (``LOGIT_ROWS``, read by the hook on
``LogitsMetadata.from_forward_batch`` through SGLang's own row selection), the larger part of a draft forward's
cost where the head projects onto the vocabulary. Everything is device tensor code with the shapes fixed by
(batch, W, steps, live): nothing is read on the host and nothing copied from it, so SGLang's draft CUDA graph can
capture the loop.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

from sglang_spec.sglang_plugin.draft_loop import DraftLoop, Level, ancestry_permutation
from sglang_spec.sglang_plugin.head_guard import HeadGuard, finite_rows

# the rows of a draft forward whose logits are computed (``forward_beams``; None: every row)
LOGIT_ROWS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("sglang_spec_logit_rows",
                                                                                 default=None)


def draft_forward(worker: Any, forward_batch: Any, loop: DraftLoop, permute_kv,
                  guard: HeadGuard | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    """``draft_forward`` for ``worker`` (an EagleDraftWorker): SGLang's (parent_list, top_scores_index,
    draft_tokens, draft_probs) with draft_probs None (greedy and target-only sampling verify never read them).
    ``permute_kv(pool, target, source)`` copies draft KV rows in every layer buffer; with ``guard`` a request whose
    head probabilities are not all finite verifies the filler tree (``head_guard``)."""
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


def forward_beams(worker: Any, forward_batch: Any, step: int, input_ids: torch.Tensor, hidden: torch.Tensor,
                  out_cache_loc: torch.Tensor, topk: int,
                  logit_rows: torch.Tensor | None = None) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Draft step ``step`` >= 1 over the batch's b * W beams, exactly as SGLang's loop runs it: input_ids [b * W]
    (full-vocabulary tokens), hidden [b * W, H] (each beam's parent state), out_cache_loc [b * W] (the step's draft
    KV slots). ``logit_rows``: [R] the rows whose logits (and last hidden states) the forward returns, None for
    all. Returns SGLang's logits output and those rows' top-``topk`` candidates ([R, topk] probabilities and
    full-vocabulary tokens, best first); advances the positions by one."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.speculative.spec_utils import renorm_draft_probs

    forward_batch.input_ids = input_ids
    forward_batch.out_cache_loc = out_cache_loc
    forward_batch.spec_info.hidden_states = hidden
    backend = worker.draft_attn_backend.attn_backends[step - 1]
    token = LOGIT_ROWS.set(logit_rows)
    try:
        with forward_context(ForwardContext(attn_backend=backend), forward_batch=forward_batch):
            output = worker.draft_runner.forward(forward_batch).logits_output
    finally:
        LOGIT_ROWS.reset(token)
    probs = renorm_draft_probs(output.next_token_logits, forward_batch.sampling_info, False)
    topk_p, topk_index = torch.topk(probs, topk, dim=-1)
    poison = getattr(getattr(worker, "_sglang_spec", None), "poison", None)
    if poison is not None:  # tests only (head_guard.INJECT_ENV)
        topk_p = poison.apply(topk_p, forward_batch.batch_size)
    if worker.hot_token_id is not None:
        topk_index = worker.hot_token_id[topk_index]
    forward_batch.positions.add_(1)
    if worker.draft_runner.model_config.model_is_mrope:
        forward_batch.mrope_positions.add_(1)
    return output, topk_p, topk_index
