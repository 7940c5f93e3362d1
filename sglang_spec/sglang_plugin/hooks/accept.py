"""Hooks of the verify step (SGLang's ``EAGLEWorkerV2``): a ragged step's forward over each request's real tree
(``ragged_verify``: the compacted forward, SGLang's CPU back-end told the lengths), per-node penalties as plain
decoding applies them, the fused accept and KV commit (``--speculative-tree-accept fused``, in or out of a CUDA
graph), what the accept tells the drafter and the metrics, and each verify's committed tokens under the overlap
scheduler. A fault in the
plugin's accept gives SGLang's own accept for the batch, in its per-node penalties SGLang's relaxed ones, in the
bookkeeping after the accept the batch's result as it is (counted, one log line; ``faults``)."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from sglang_spec.sglang_plugin.committed import CommittedOutputs
from sglang_spec.sglang_plugin.drafters.base import VerifyOutcome
from sglang_spec.sglang_plugin.drafters.beams import supports_row_permutation
from sglang_spec.sglang_plugin.faults import (ACCEPT, COMMIT, COUNTS, OBSERVE, PENALTIES, RECORD, FaultInjection,
                                              FaultOnAnotherRank, accept_fault)
from sglang_spec.sglang_plugin.fused_accept import (ACCEPT_KERNELS_ENV, TRITON_KERNELS, FusedAccept, KVCommit,
                                                    SGLangAccept, accept_kernels)
from sglang_spec.sglang_plugin.hooks.draft import claim_acceptance_metrics
from sglang_spec.sglang_plugin.messages import log
from sglang_spec.sglang_plugin.metrics import METRICS, RANKS, VERIFY_TOKENS
from sglang_spec.sglang_plugin.peers import accept_tp_group, attention_tp_rank
from sglang_spec.sglang_plugin.penalties import RequestPenalties, tree_penalties
from sglang_spec.sglang_plugin.ragged_verify import (COMPACT_GRAPHS, RAGGED_ATTRIBUTE, compact_forward,
                                                    compact_graphs_wanted, ragged_extend_metadata)
from sglang_spec.sglang_plugin.state import VERIFY_STEP, VerifyStep, WorkerState, attach, state_of
from sglang_spec.tree.encode_sglang import TreeMaskMode


def eagle_worker_init_after(result, worker, *args, **kwargs):
    """The target worker shares its draft worker's state, completed here: injected accept faults (tests), the
    overlap scheduler's committed outputs, and the fused accept."""
    state: WorkerState | None = state_of(getattr(worker, "draft_worker", None))
    if state is None:
        return result
    attach(worker, state)
    _start_accept_faults(state)
    _start_committed_outputs(state)
    if state.options.accept != "fused":
        return result
    from sglang.srt.utils import is_hip

    claim_acceptance_metrics(worker.server_args, attention_tp_rank())
    kernels = accept_kernels(os.environ.get(ACCEPT_KERNELS_ENV, ""), worker.device)
    # the accepted path's bound is the tree's depth (``WorkerState.step_depth``), past SGLang's steps for context trees
    state.fused = FusedAccept(worker.speculative_num_draft_tokens, state.options.depth, worker.device,
                              METRICS, tp_group=accept_tp_group(), broadcast_greedy=is_hip(), kernels=kernels)
    if kernels is not TRITON_KERNELS:
        log(f"fused accept: the kernels' pure-torch references ({ACCEPT_KERNELS_ENV}={kernels.name})")
    # before capture (a server without decode graphs never calls it)
    worker.target_worker.model_runner.capture_tail_hooks.append(state.fused.capture_tail)
    return result


def _start_committed_outputs(state: WorkerState) -> None:
    """With the overlap scheduler (a step's result processed after the next step is launched) the requests' output
    ids lag a step: every verify's committed tokens are kept (``committed``) for the next step's exact penalties and
    host context trees."""
    from sglang.srt.runtime_context import get_schedule

    if get_schedule().disable_overlap_schedule:  # the resolved loop (SGLang turns it off on a CPU, for one)
        return
    # a host context drafter reads every step's output; one on the device keeps its own history
    every_step = state.drafter.reads_outputs
    state.committed = CommittedOutputs(every_step=every_step)
    if every_step:
        state.drafter.use_outputs(state.committed)
    log("overlap scheduler: each verify's committed tokens complete the next step's penalties"
        + (" and context trees" if every_step else "") + " (SGLang's output ids lag a step)")


def _start_accept_faults(state: WorkerState) -> None:
    """Tests: the worker's injected accept faults (``faults``), over the stages its server runs; the draft hook
    fires the context drafter's (OBSERVE)."""
    options = state.options
    stages = ((ACCEPT, COMMIT) if options.accept == "fused" else ()) + (RECORD,)
    stages += (OBSERVE,) if options.uses_context else ()
    faults = state.faults or FaultInjection()
    faults.arm_accept(attention_tp_rank(), stages)
    if faults.accept is not None:
        state.faults = faults


def verify_around(original, worker, *args, **kwargs):
    """A tree server's verify: its step state (``VerifyStep``) for the functions SGLang calls inside it."""
    state: WorkerState | None = state_of(worker)
    if state is None:
        return original(worker, *args, **kwargs)
    if state.faults is not None and state.faults.accept is not None:
        state.faults.accept.arm()
    token = VERIFY_STEP.set(VerifyStep(state))
    batch = args[0] if args else kwargs.get("batch")
    ragged = getattr(getattr(batch, "spec_info", None), RAGGED_ATTRIBUTE, None)
    if state.ragged and not batch.forward_mode.is_idle():
        dense = len(batch.reqs) * batch.spec_info.draft_token_num
        state.verified_tokens = dense if ragged is None else ragged.total
        VERIFY_TOKENS.record(state.verified_tokens, dense)
    try:
        with (contextlib.nullcontext() if ragged is None else
              compact_forward(worker.target_worker, ragged, TreeMaskMode(int(worker.draft_worker.tree_mask_mode)))):
            return original(worker, *args, **kwargs)
    finally:
        VERIFY_STEP.reset(token)


def build_extend_metadata_around(original, backend, forward_batch, *args, **kwargs):
    """SGLang's CPU attention back-end: a compacted verify forward's per-request lengths (``ragged_verify``)."""
    metadata = ragged_extend_metadata(forward_batch, backend.device)
    return original(backend, forward_batch, *args, **kwargs) if metadata is None else metadata


def graph_runner_init_around(original, runner, model_runner, *args, **kwargs):
    """A decode graph runner of a tree server: built in SGLang's compact ragged mode where its verifies are ragged
    (``ragged_verify.compact_graphs_wanted``: graphs per tier of total verify tokens)."""
    from sglang.srt.runtime_context import get_spec

    width = kwargs.get("speculative_num_draft_tokens") or get_spec().speculative_num_draft_tokens or 1
    backend = kwargs.get("attn_backend") or model_runner.attn_backend
    token = COMPACT_GRAPHS.set(compact_graphs_wanted(model_runner, backend, width))
    try:
        return original(runner, model_runner, *args, **kwargs)
    finally:
        COMPACT_GRAPHS.reset(token)


def compact_graphs_around(original, spec_algorithm) -> bool:
    """SGLang's switch of its compact ragged verify graphs (DSpark's, by ``SGLANG_RAGGED_VERIFY_MODE``), on too for
    a tree server's runner built with ragged verifies (``graph_runner_init_around``)."""
    return COMPACT_GRAPHS.get() or original(spec_algorithm)


def graph_spec_info_after(result, runner, num_tokens: int, *args, **kwargs):
    """The verify input a compact-mode runner captures a tier with: SGLang's capture layout on it (SGLang puts it
    on DFlash's only), which the back-end's capture metadata reads."""
    if runner.ragged_verify_mode and result is not None and getattr(result, "ragged_verify_layout", None) is None:
        result.ragged_verify_layout = runner._capture_ragged_verify_layout(num_tokens)
    return result


def eagle_sample_around(original, verify_input, batch, logits_output, *args, **kwargs):
    """On a tree server: penalties per node as plain decoding applies them (``penalties``), then SGLang's or the
    fused accept; then the accept to the drafter (context trees learn from it) and (with --enable-metrics) the
    per-(depth, rank) counts on the device."""
    step = VERIFY_STEP.get()
    if step is not None and not batch.forward_mode.is_idle():
        original = functools.partial(_with_exact_penalties, original)
    result = _eagle_sample(original, verify_input, batch, logits_output, *args, **kwargs)
    if batch.forward_mode.is_idle() or step is None:
        return result
    try:  # bookkeeping on an accept already made: a fault skips it, the batch's result stands
        predict, accept_lens, accept_index = result
        step.state.drafter.record_outcome(VerifyOutcome(batch.req_pool_indices, predict, accept_index, accept_lens,
                                                        verify_input.draft_token_num))
        committed = step.state.committed
        if committed is not None and (committed.every_step or _penalised(batch)):
            committed.record([req.rid for req in batch.reqs], batch.seq_lens, predict, accept_index, accept_lens)
        step.fire(RECORD)
        if RANKS.enabled and len(accept_index):
            RANKS.record(verify_input.retrieve_next_token, verify_input.retrieve_next_sibling, accept_index)
    except Exception as error:
        accept_fault(RECORD, error, len(batch.reqs), "accepted; its bookkeeping after the accept not finished")
    return result


def _penalised(batch) -> bool:
    """Whether the batch's requests carry penalties (SGLang's accumulated penalties are set only then)."""
    info = batch.sampling_info
    return info.acc_additive_penalties is not None or info.acc_scaling_penalties is not None


def _with_exact_penalties(original, verify_input, batch, logits_output, *args, **kwargs):
    """SGLang's eagle_sample, with a penalised batch's penalties applied per node first (``penalties``) and SGLang's
    relaxed ones (the root's, for every node) held back for the call. The fused accept never gets here with
    penalties: it leaves such batches to SGLang's path. A fault in the per-node penalties (computed on the host
    before the logits are touched) leaves the batch to SGLang's relaxed ones, counted."""
    if not _penalised(batch):
        return original(verify_input, batch, logits_output, *args, **kwargs)
    info = batch.sampling_info
    logits = logits_output.next_token_logits
    try:
        exact = _exact_penalties(verify_input, batch, logits)
        if exact is not None:
            exact.apply(logits)
    except Exception as error:
        accept_fault(PENALTIES, error, len(batch.reqs), "penalised by SGLang's relaxed penalties (the root's, for "
                                                        "every node)")
        exact = None
    if exact is None:  # a request's output not known whole (``committed``), or a fault: SGLang's relaxed penalties
        return original(verify_input, batch, logits_output, *args, **kwargs)
    saved = info.acc_additive_penalties, info.acc_scaling_penalties
    info.acc_additive_penalties = info.acc_scaling_penalties = None
    try:
        return original(verify_input, batch, logits_output, *args, **kwargs)
    finally:
        info.acc_additive_penalties, info.acc_scaling_penalties = saved


def _exact_penalties(verify_input, batch, logits: torch.Tensor):
    """The batch's penalties per tree node (``penalties.TreePenalties``), None where a request's output is not
    known whole."""
    info = batch.sampling_info
    bs = len(batch.reqs)
    nodes = verify_input.draft_token_num
    additive = info.acc_additive_penalties
    stop_tokens = (torch.isneginf(additive) if additive is not None
                   else torch.zeros(bs, logits.shape[-1], dtype=torch.bool, device=logits.device))
    tokens = verify_input.draft_token.view(bs, nodes)
    step = VERIFY_STEP.get()
    outputs = _committed_outputs(batch, step.state.committed if step is not None else None, tokens[:, 0])
    return tree_penalties([RequestPenalties.of(req, output) for req, output in zip(batch.reqs, outputs)], tokens,
                          verify_input.retrieve_next_token, verify_input.retrieve_next_sibling, stop_tokens,
                          logits.shape[-1])


def _committed_outputs(batch, committed: CommittedOutputs | None, roots: torch.Tensor) -> list[list[int] | None]:
    """Each request's committed output for this verify (None: its ``output_ids`` as they are, complete without the
    overlap scheduler); a first output not known whole is logged once (SGLang's relaxed penalties serve it)."""
    if committed is None:
        return [None] * len(batch.reqs)
    outputs = [committed.output(req, kv_length, root)
               for req, kv_length, root in zip(batch.reqs, batch.seq_lens.tolist(), roots.tolist())]
    committed.report_first_unknown()
    return outputs


def _eagle_sample(original, verify_input, batch, logits_output, grammar_mask=None, uno_target_max_top_k=None,
                  **kwargs):
    step = VERIFY_STEP.get()
    fused = None if step is None else step.state.fused
    if step is None or fused is None or batch.forward_mode.is_idle():
        return original(verify_input, batch, logits_output, grammar_mask, uno_target_max_top_k, **kwargs)
    accepted = None
    if not step.fused_fault:
        try:
            accepted = _fused_accept(step, fused, verify_input, batch, logits_output, grammar_mask,
                                     uno_target_max_top_k, **kwargs)
        except Exception as error:  # the fused accept wrote only its own buffers: SGLang's accept starts afresh
            accept_fault(ACCEPT, error, len(batch.reqs), "accepted by SGLang's eagle_sample")
            fused.count("fault")
    broadcasts = fused.broadcasts(sampled=not batch.sampling_info.is_all_greedy)
    peers = step.state.peers
    if broadcasts and peers is not None and peers.any_rank(accepted is None) and accepted is not None:
        accept_fault(ACCEPT, FaultOnAnotherRank("another tensor-parallel rank's accept of this batch is SGLang's"),
                     len(batch.reqs), "accepted by SGLang's eagle_sample on every rank")
        accepted = None
    if accepted is None:
        return original(verify_input, batch, logits_output, grammar_mask, uno_target_max_top_k, **kwargs)
    if broadcasts:
        fused.agree(accepted)
    fused.count("fused")
    step.accepted = True
    return accepted.predict, accepted.accept_lens, accepted.accept_index


def _fused_accept(step: VerifyStep, fused: FusedAccept, verify_input, batch, logits_output, grammar_mask,
                  uno_target_max_top_k, **kwargs) -> SGLangAccept | None:
    """The fused accept of one batch, or None where SGLang's path must serve it (counted by reason)."""
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.speculative import eagle_utils, spec_utils
    from sglang.srt.utils.async_probe import sanitize_nan_logits

    reason = fused.fallback_reason(batch, verify_input, grammar_mask, uno_target_max_top_k,
                                   kwargs.get("watermark_state"), get_spec())
    if reason is None and spec_utils.SIMULATE_ACC_LEN > 0:
        reason = "simulated_acceptance"
    if reason is not None:
        fused.count(reason)
        return None
    logits = logits_output.next_token_logits
    sanitize_nan_logits(logits, "verify: target model logits")
    coins = None
    if not batch.sampling_info.is_all_greedy:  # SGLang's own coins, drawn as eagle_sample draws them
        bs = len(batch.seq_lens)
        candidates = verify_input.draft_token.reshape(bs, verify_input.draft_token_num)
        coins = eagle_utils._verify_coins(sampling_info=batch.sampling_info, seq_lens=batch.seq_lens,
                                          draft_token_num=verify_input.draft_token_num, candidates=candidates,
                                          device=batch.device)
    accepted = fused.sample(verify_input, batch, logits, coins, step.replayed)
    step.fire(ACCEPT)  # tests: a fault with the fused outputs written
    return accepted


def move_accept_tokens_around(original, batch, accept_index, num_correct_drafts, token_to_kv_pool_allocator):
    if batch.out_cache_loc.shape[0] == len(batch.seq_lens):
        # one verified slot a request (a plain step: tree auto's, SGLang's 0-step path): each accepted token is its
        # window's root, whose KV already sits at the window's front; SGLang's move copies every layer's rows onto
        # themselves
        return None
    step = VERIFY_STEP.get()
    pool = token_to_kv_pool_allocator.get_kvcache()
    if step is None or not step.accepted or not supports_row_permutation(pool):
        return original(batch, accept_index, num_correct_drafts, token_to_kv_pool_allocator)
    fused = step.state.fused
    assert fused is not None  # only the fused path accepts
    nodes = batch.out_cache_loc.shape[0] // len(batch.seq_lens)
    bs = len(batch.seq_lens)
    try:
        commit = KVCommit.of(pool, batch.out_cache_loc, accept_index, num_correct_drafts + 1, nodes, fused.kernels)
    except Exception as error:  # nothing moved yet
        accept_fault(COMMIT, error, bs, "its KV moved by SGLang's move_accept_tokens_to_target_kvcache")
        return original(batch, accept_index, num_correct_drafts, token_to_kv_pool_allocator)
    try:
        commit.run(between=lambda: step.fire(COMMIT))  # tests: a fault with the first layer buffer moved
    except Exception as error:  # each buffer moved whole or not at all: the rest by torch, none twice
        accept_fault(COMMIT, error, bs, f"its KV moved by the kernel in {commit.done} of {len(commit.buffers)} "
                                        f"layer buffers, by torch in the rest")
        commit.finish()
    return None


def graph_execute_around(original, runner, forward_batch, *args, **kwargs):
    """Under CUDA graphs: the verify replay's static tree links before it; after it, the greedy accept of the graph
    SGLang replayed, for this verify step only."""
    step = VERIFY_STEP.get()
    fused = None if step is None else step.state.fused
    if (step is None or fused is None or runner.model_runner.is_draft_worker
            or not forward_batch.forward_mode.is_target_verify()
            or not fused.serves_width(forward_batch.spec_info.draft_token_num)):
        return original(runner, forward_batch, *args, **kwargs)
    try:
        fused.before_replay(forward_batch)
    except Exception as error:  # the graph's links may be half written: its accept is not read
        accept_fault(ACCEPT, error, forward_batch.batch_size, "accepted by SGLang's eagle_sample")
        fused.count("fault")
        step.fused_fault = True
    output = original(runner, forward_batch, *args, **kwargs)
    if not step.fused_fault:
        try:
            step.replayed = fused.replayed(runner, forward_batch)
        except Exception as error:
            accept_fault(ACCEPT, error, forward_batch.batch_size, "accepted by SGLang's eagle_sample")
            fused.count("fault")
            step.fused_fault = True
    return output


def correct_drafts_after(result, request, num_correct_drafts):
    try:
        METRICS.record(num_correct_drafts)  # counts on attention-TP rank 0 only (METRICS.counting)
    except Exception as error:
        accept_fault(COUNTS, error, 1, "its acceptance counts skipped")
    return result
