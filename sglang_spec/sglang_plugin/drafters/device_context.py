"""``lookup`` and ``hybrid`` trees grown on the device (``--speculative-tree-context-on device``): the host builder's
trees from each request's device token history (``device_history``), the head's rounds as padded beams, padded
and encoded there, with no host read in the draft step (``device_trees/lookup``, ``device_trees/hybrid``).

Learning is deferred to the device: a verify's accepted paths are queued with a CUDA event and observed once the
device has finished them (``observe_outcome`` never waits for it).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import torch

from sglang_spec.device_trees.hybrid import (HybridGrowth, HybridShape, HybridTrees, SourceEstimates,
                                             build_hybrid_trees, hybrid_draft_trees)
from sglang_spec.device_trees.lookup import (LookupTrees, NgramMatch, build_lookup_trees, lookup_draft_trees,
                                             lookup_estimates)
from sglang_spec.kernels.ngram_match import ngram_match, ngram_match_reference
from sglang_spec.sglang_plugin.drafters.base import DraftCall, SGLangDraft, VerifyOutcome
from sglang_spec.sglang_plugin.drafters.beams import head_round, pad_head_rounds
from sglang_spec.sglang_plugin.drafters.context import ContextDrafter
from sglang_spec.sglang_plugin.drafters.device_history import DeviceHistory
from sglang_spec.sglang_plugin.drafters.head_guard import HeadGuard, finite_rows
from sglang_spec.sglang_plugin.drafters.padding import pad_to_budget_device
from sglang_spec.sglang_plugin.metrics import SourceMetrics
from sglang_spec.tree.encode_sglang import encode_sglang_draft_device
from sglang_spec.tree.policies import TreePolicy


class DeviceContextDrafter(ContextDrafter):
    """What both device drafters hold: the requests' device history (made at the first draft: it needs SGLang's
    request table), the trees of the last draft, and the queue of verified outcomes not yet observed."""

    def __init__(self, policy: TreePolicy, steps: int, budget: int, metrics: SourceMetrics | None = None) -> None:
        super().__init__(policy, steps, budget, metrics)
        self.history: DeviceHistory | None = None
        self.proposed_on_device: LookupTrees | HybridTrees | None = None
        self.proposed_finite: torch.Tensor | None = None  # [bs] bool: hybrid rows drafted from a finite head output
        self._device_outcomes: deque[tuple[LookupTrees | HybridTrees, torch.Tensor | None, torch.Tensor, int,
                                           Any]] = deque()

    def record_outcome(self, outcome: VerifyOutcome) -> None:
        """The verify's tokens into the history; the accepted paths of the trees last proposed are queued, observed
        once the device has finished the accept (``observe_outcome`` never waits for it): a CUDA event marks that
        point."""
        if self.history is not None:
            self.history.append(outcome.slots, outcome.predict, outcome.accept_index, outcome.accept_lens)
        if self.proposed_on_device is None:
            return
        accepted = outcome.accept_index.clone()  # SGLang may reuse its buffer before the outcome is read
        event = None
        if accepted.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._device_outcomes.append((self.proposed_on_device, self.proposed_finite, accepted, outcome.verify_tokens,
                                      event))
        self.proposed_on_device, self.proposed_finite = None, None

    def forget_proposal(self) -> None:
        self.proposed_on_device, self.proposed_finite = None, None

    def observe_outcome(self) -> None:
        """The device's outcomes, oldest first, as far as the device has finished them."""
        while self._device_outcomes:
            grown, finite, accepted, tokens, event = self._device_outcomes[0]
            if event is not None and not event.query():
                break
            self._device_outcomes.popleft()
            if isinstance(grown, HybridTrees):
                rows = None if finite is None else finite.tolist()
                self._observe(hybrid_draft_trees(grown, self.drafter.counts, rows), accepted, tokens)
            else:
                self._observe(lookup_draft_trees(grown, self.drafter.counts), accepted, tokens)


class DeviceLookupDrafter(DeviceContextDrafter):
    def draft(self, call: DraftCall) -> SGLangDraft:
        assert call.requests is not None, "context trees are drafted eagerly, never in a draft graph capture"
        return device_lookup_draft_forward(call.worker, call.forward_batch, call.requests, self)


class DeviceHybridDrafter(DeviceContextDrafter):
    """``guard``: a request drafted from a non-finite head output verifies the filler tree."""

    def __init__(self, policy: TreePolicy, steps: int, budget: int, guard: HeadGuard,
                 metrics: SourceMetrics | None = None) -> None:
        super().__init__(policy, steps, budget, metrics)
        self.guard = guard

    def draft(self, call: DraftCall) -> SGLangDraft:
        assert call.requests is not None, "context trees are drafted eagerly, never in a draft graph capture"
        return device_hybrid_draft_forward(call.worker, call.forward_batch, call.requests, self)


def _device_contexts(worker: Any, forward_batch: Any, reqs: Sequence[Any], drafter: DeviceContextDrafter
                     ) -> tuple[torch.Tensor, torch.Tensor, NgramMatch]:
    """The requests' device histories, admitted and ready to match (history table, lengths, the n-gram kernel or
    its reference): on a CPU only as many columns as the longest history (the reference scans every column)."""
    spec_info = forward_batch.spec_info
    device = spec_info.bonus_tokens.device
    if drafter.history is None:
        table = worker.draft_runner.req_to_token_pool.req_to_token
        drafter.history = DeviceHistory(table.shape[0], table.shape[1] + drafter.budget + 2, device)
    history = drafter.history
    history.admit(reqs, getattr(forward_batch, "seq_lens_cpu", None), spec_info.bonus_tokens)
    match = ngram_match if device.type == "cuda" else ngram_match_reference
    tokens = history.tokens
    if device.type == "cpu":  # the CPU bed: lengths are host memory, and the reference scans every column it gets
        tokens = tokens[:, : int(history.lengths.max()) + 1]
    return tokens, history.lengths, match


def device_lookup_draft_forward(worker: Any, forward_batch: Any, reqs: Sequence[Any],
                                drafter: DeviceContextDrafter) -> SGLangDraft:
    """``draft_forward`` for a ``lookup`` server with --speculative-tree-context-on device: the batch's trees grown
    on the device (``device_trees/lookup``, the host builder's trees) from the requests' device histories, padded
    and encoded there; the host reads nothing (the requests new to their rows are written from host lists).
    The caller has had the drafter observe what the device has finished accepting."""
    tokens, lengths, match = _device_contexts(worker, forward_batch, reqs, drafter)
    policy = drafter.drafter.policy
    device = tokens.device
    # the growth keeps every continuation a node has: SGLang's encoding needs width * (depth - 1) >= budget with
    # depth <= budget, so the width is at least 2, the policy's lookup width (``options._width``)
    assert worker.topk >= policy.lookup_width
    trees = build_lookup_trees(tokens, lengths, forward_batch.req_pool_indices.long(),
                               lookup_estimates(drafter.drafter.counts, device), policy.budget, policy.depth,
                               policy.lookup_width, match=match)
    drafter.proposed_on_device = trees
    parents, tokens = pad_to_budget_device(trees.parents, trees.tokens, trees.num_nodes, drafter.budget,
                                           worker.topk, drafter.steps)
    parent_list, top_scores_index, draft_tokens = encode_sglang_draft_device(parents, tokens, worker.topk,
                                                                             drafter.steps)
    return parent_list, top_scores_index, draft_tokens, None


def device_hybrid_draft_forward(worker: Any, forward_batch: Any, reqs: Sequence[Any],
                                drafter: DeviceContextDrafter) -> SGLangDraft:
    """``draft_forward`` for a ``hybrid`` server with --speculative-tree-context-on device: the batch's trees grown
    on the device (``device_trees/hybrid``, the host builder's trees), the head's rounds run as the host path runs
    them (``forward_beams``: a round's nodes are its beams, each beam's KV column given its parent's history
    first), padded and encoded there, with no host read. Every head level the policy allows runs (a request
    whose tree stops asking gets its slots masked), so the step's shape is fixed; under DP attention the levels
    past the policy's run over dummy beams too (``all_head_rounds``). A request whose head
    probabilities are not all finite verifies the filler tree (``head_guard``; not observed)."""
    from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc

    contexts, lengths, match = _device_contexts(worker, forward_batch, reqs, drafter)
    policy = drafter.drafter.policy
    spec_info = forward_batch.spec_info
    batch, width, topk = forward_batch.batch_size, worker.topk, policy.effective_topk
    device = contexts.device
    shape = HybridShape(budget=policy.budget, depth=policy.depth, width=policy.width, topk=topk,
                        mtp_levels=policy.mtp_levels, lookup_width=policy.lookup_width, max_ngram=policy.max_ngram)
    assert shape.round_width <= width and shape.head_rounds < drafter.steps
    root_index = spec_info.topk_index[:, :topk]
    if worker.hot_token_id is not None:
        root_index = worker.hot_token_id[root_index]
    root_probs = spec_info.topk_p[:, :topk].float()
    finite = finite_rows(root_probs, batch)
    step_locs = per_step_draft_out_cache_loc(forward_batch.out_cache_loc, batch, width, drafter.steps)
    beams = torch.arange(width, device=device)
    requests = torch.arange(batch, device=device)[:, None]
    carried = {"state": spec_info.hidden_states, "finite": finite, "rounds": 0}
    beam_of: list[torch.Tensor] = []  # [R, C + 1]: each node's beam in the last head round (the root: 0)

    def head(level: int, nodes: torch.Tensor, growth: HybridGrowth) -> tuple[torch.Tensor, torch.Tensor]:
        step = level + 1
        if not beam_of:
            beam_of.append(torch.zeros_like(growth.tokens))
        listed = nodes >= 0
        slots = nodes.shape[1]
        node_ids = nodes.clamp(min=0)
        tokens = torch.zeros(batch, width, dtype=torch.int64, device=device)
        tokens[:, :slots] = torch.where(listed, torch.gather(growth.tokens, 1, node_ids), 0)
        parent_beam = beams.repeat(batch, 1)  # a beam of no node reads its own column, as the host path's
        parents = torch.gather(growth.parents, 1, node_ids).clamp(min=0)
        parent_beam[:, :slots] = torch.where(listed, torch.gather(beam_of[0], 1, parents), beams[:slots])
        node_beams = None if slots == width else (requests * width + beams[:slots]).reshape(-1)
        output, topk_p, topk_index = head_round(worker, forward_batch, step, tokens, parent_beam, carried["state"],
                                                step_locs, topk, node_beams)
        carried["state"] = output.hidden_states
        carried["rounds"] = step
        probs = topk_p.float().view(batch, width, topk)[:, :slots]
        carried["finite"] = carried["finite"] & torch.where(listed[..., None], torch.isfinite(probs), True).view(
            batch, -1).all(1)
        spare = growth.tokens.shape[1] - 1
        beam_of[0] = torch.zeros_like(growth.tokens).scatter_(1, torch.where(listed, nodes, spare),
                                                              beams[:slots].expand(batch, -1).contiguous())
        return topk_index.view(batch, width, topk)[:, :slots], probs

    trees = build_hybrid_trees(contexts, lengths, forward_batch.req_pool_indices.long(), root_index, root_probs,
                               head, SourceEstimates.of(drafter.drafter.counts, device), shape, match=match)
    if drafter.all_head_rounds:
        pad_head_rounds(worker, forward_batch, carried["rounds"], drafter.steps, carried["state"], step_locs)
    drafter.proposed_on_device = trees
    drafter.proposed_finite = carried["finite"]
    parents, tokens = pad_to_budget_device(trees.parents, trees.tokens, trees.num_nodes, drafter.budget, width,
                                           drafter.steps)
    parent_list, top_scores_index, draft_tokens = encode_sglang_draft_device(parents, tokens, width, drafter.steps)
    if drafter.guard is not None:
        parent_list, top_scores_index, draft_tokens = drafter.guard.select(carried["finite"], parent_list,
                                                                           top_scores_index, draft_tokens)
    return parent_list, top_scores_index, draft_tokens, None
