"""The plugin's own ``draft_forward`` for SGLang's EAGLE v2 worker (``EagleDraftWorker.draft_forward`` replaced
when the tree policy is sequoia or specexec; eagle and chain keep SGLang's loop).

Per step it runs SGLang's draft model on the W beams exactly as SGLang's loop does (same attention backends,
same per-step KV slots, same hot-token map, same softmax), and does the rest with ``draft_loop.DraftLoop``:
each node keeps its top-K candidates as children, the next beams are chosen by the policy, and before a beam
is forwarded its KV column is overwritten with its parent's, so every node attends to its own ancestors only.
Everything is device tensor code with the shapes fixed by (batch, W, steps): nothing is read on the host and
nothing copied from it, so SGLang's draft CUDA graph can capture the loop.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_spec.sglang_plugin.draft_loop import DraftLoop, Level, ancestry_permutation


def draft_forward(worker: Any, forward_batch: Any, loop: DraftLoop, permute_kv) -> tuple[torch.Tensor, torch.Tensor,
                                                                                             torch.Tensor, None]:
    """``draft_forward`` for ``worker`` (an EagleDraftWorker): SGLang's (parent_list, top_scores_index,
    draft_tokens, draft_probs) with draft_probs None (greedy and target-only sampling verify never read them).
    ``permute_kv(pool, target, source)`` copies draft KV rows in every layer buffer."""
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
    levels: list[Level] = [level]
    hidden = spec_info.hidden_states.repeat_interleave(width, dim=0)  # [b * W, H], the root's state per beam
    beam_offsets = (torch.arange(batch, device=hidden.device) * width)[:, None]
    for step in range(1, loop.steps):
        output, topk_p, topk_index = forward_beams(worker, forward_batch, step, level.beam_tokens, hidden,
                                                   step_locs[step - 1], width)
        level = loop.next_level(step, level.beam_scores, topk_p, topk_index)
        levels.append(level)
        if step < loop.steps - 1:  # the last level is never forwarded: no state or history to carry
            hidden = output.hidden_states[(level.parent_beam + beam_offsets).reshape(-1)]
            target, source = ancestry_permutation(level.parent_beam, step_locs, step)
            permute_kv(pool, target, source)
    parent_list, top_scores_index, draft_tokens = loop.organize(levels, worker.speculative_num_draft_tokens - 1)
    return parent_list, top_scores_index, draft_tokens, None


def forward_beams(worker: Any, forward_batch: Any, step: int, input_ids: torch.Tensor, hidden: torch.Tensor,
                  out_cache_loc: torch.Tensor, topk: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Draft step ``step`` >= 1 over the batch's b * W beams, exactly as SGLang's loop runs it: input_ids [b * W]
    (full-vocabulary tokens), hidden [b * W, H] (each beam's parent state), out_cache_loc [b * W] (the step's draft
    KV slots). Returns SGLang's logits output and each beam's top-``topk`` candidates ([b * W, topk] probabilities
    and full-vocabulary tokens, best first); advances the positions by one."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.speculative.spec_utils import renorm_draft_probs

    forward_batch.input_ids = input_ids
    forward_batch.out_cache_loc = out_cache_loc
    forward_batch.spec_info.hidden_states = hidden
    backend = worker.draft_attn_backend.attn_backends[step - 1]
    with forward_context(ForwardContext(attn_backend=backend), forward_batch=forward_batch):
        output = worker.draft_runner.forward(forward_batch).logits_output
    probs = renorm_draft_probs(output.next_token_logits, forward_batch.sampling_info, False)
    topk_p, topk_index = torch.topk(probs, topk, dim=-1)
    if worker.hot_token_id is not None:
        topk_index = worker.hot_token_id[topk_index]
    forward_batch.positions.add_(1)
    if worker.draft_runner.model_config.model_is_mrope:
        forward_batch.mrope_positions.add_(1)
    return output, topk_p, topk_index
