"""Hooks of the draft worker (SGLang's ``EagleDraftWorker``): its start-up builds the worker's state and chooses its
drafter (``drafters.choose``); each draft step calls that drafter; a draft that raises verifies the filler tree for
its batch (counted, one log line); the head's forwards are skipped where no tree reads them.

Per batch, nothing of the plugin's raises into SGLang's scheduler: a fault in the draft gives the filler tree, in
the drafter's learning the counts it had, in the head-fault count its step uncounted, in a skipped head pass's stub
SGLang's own draft extend (each counted and logged in one line, ``faults``)."""

from __future__ import annotations

import contextlib
import time

import torch

from sglang_spec.errors import SpecError
from sglang_spec.sglang_plugin.drafters.base import DraftCall, ServedDrafter
from sglang_spec.sglang_plugin.drafters.beams import spread_rows, supports_row_permutation, zero_kv
from sglang_spec.sglang_plugin.drafters.choose import drafter_for
from sglang_spec.sglang_plugin.drafters.filler import filler_draft, filler_encoding
from sglang_spec.sglang_plugin.drafters.head_guard import ERROR as HEAD_FAULT
from sglang_spec.sglang_plugin.drafters.head_guard import HeadGuard
from sglang_spec.sglang_plugin.drafters.sglang_loop import keep_ancestry
from sglang_spec.sglang_plugin.faults import (EXTEND_ROWS, FAULT_ENV, HEAD_FAULTS, HEAD_SKIP, OBSERVE, RAGGED,
                                              FaultInjection, FaultOnAnotherRank, InjectedFault, accept_fault,
                                              capturing, plugin_fault)
from sglang_spec.sglang_plugin.messages import StartupError, log
from sglang_spec.sglang_plugin.metrics import METRICS, PLANS, RANKS, SOURCES, VERIFY_TOKENS
from sglang_spec.sglang_plugin.peers import Peers, PlanGroup, attention_tp_rank, dp_attention
from sglang_spec.sglang_plugin.ragged_verify import RAGGED_ATTRIBUTE, RaggedVerify, unlink_fillers
from sglang_spec.sglang_plugin.ragged_verify import decide as decide_ragged
from sglang_spec.sglang_plugin.state import (LOGIT_ROWS, SGLANG_LOOP_STEP, WorkerState, attach, options_of,
                                             state_of)


def draft_worker_init_after(result, worker, *args, **kwargs):
    """The worker's state, its drafter chosen once (a shape that does not fit is one ``error:`` line). The draft KV
    pool is allocated later (Scheduler.init_memory_pools): ancestry is decided in ``alloc_memory_pool_after``."""
    options = options_of(worker.server_args)
    if options is None:
        return result
    width, steps, budget = worker.topk, worker.speculative_num_steps, worker.speculative_num_draft_tokens - 1
    filler = filler_encoding(budget, width, steps)
    dp = dp_attention()
    try:
        # guards' tensors live on the device before any draft graph is captured
        drafter = drafter_for(options, width, steps, budget, worker.device, filler, dp_attention=dp)
    except SpecError as error:  # validated at start-up already; a mismatch here is a bug, said plainly
        raise StartupError(error) from None
    rank = attention_tp_rank()
    attach(worker, WorkerState(options, drafter, width, steps, budget + 1, filler, peers=Peers.of_worker(),
                               plan_group=PlanGroup.of_worker() if options.auto else None,
                               faults=FaultInjection.from_environment(rank), dp_attention=dp))
    claim_acceptance_metrics(worker.server_args, rank)
    return result


def claim_acceptance_metrics(server_args, rank: int) -> bool:
    """At worker start-up: attention-TP rank 0 counts acceptance (and registers its counters with
    ``--enable-metrics``); every attention-TP rank runs the same requests through the same verify, so the others
    count nothing (else SGLang's multiprocess metrics would sum each total TP times). Returns whether this
    process counts."""
    METRICS.counting = rank == 0
    if METRICS.counting and getattr(server_args, "enable_metrics", False):
        METRICS.enable_prometheus()
        PLANS.enable_prometheus()  # tree auto's choices
        VERIFY_TOKENS.enable_prometheus()  # ragged verify's computed tokens
        RANKS.enable(prometheus=True)  # per-(depth, rank) acceptance, once per step (calibrate --from-server)
        SOURCES.enable()  # per-source outcomes of lookup / hybrid trees (calibrate --from-server)
    return METRICS.counting


def alloc_memory_pool_after(result, worker, *args, **kwargs):
    """Trees need a draft KV pool that lets every branch keep its own ancestry (one token a row)."""
    state: WorkerState | None = state_of(worker)
    if state is None or state.width == 1:
        return result
    pool = worker.draft_runner.token_to_kv_pool
    if not supports_row_permutation(pool):
        raise StartupError(
            f"the draft KV pool ({type(pool).__name__}, layout {getattr(pool, 'kv_cache_layout', 'unknown')}) does "
            f"not hold one token a row, so tree branches cannot each keep their own ancestry; use the NHD layout "
            f"(unset SGLANG_USE_HND_KVCACHE and the vectorized_5d / page-major layouts), or "
            f"--speculative-tree-policy chain"
        )
    state.drafter.exact_ancestry = True
    return result


def draft_around(original, worker, batch, *args, **kwargs):
    """A draft step: an eager drafter's (host-built trees cannot replay a captured draft graph) sees the batch's
    requests; a guarded drafter's non-finite head outputs since the last step are counted."""
    state: WorkerState | None = state_of(worker)
    if state is None:
        return original(worker, batch, *args, **kwargs)
    drafter = state.drafter
    if not drafter.eager:  # the own loop, eager or replayed from its graph; SGLang's loop
        verify_input = original(worker, batch, *args, **kwargs)
    else:
        graph_runner, worker.cuda_graph_runner = worker.cuda_graph_runner, None
        state.draft_requests = list(batch.reqs)
        try:
            verify_input = original(worker, batch, *args, **kwargs)
        finally:
            worker.cuda_graph_runner = graph_runner
            state.draft_requests = None
        if decide_ragged(state, worker):
            runner = worker.target_worker.model_runner.decode_cuda_graph_runner  # this step's size's
            _make_ragged(state, verify_input, len(batch.reqs),
                         ragged_graphs=bool(getattr(runner, "ragged_verify_mode", False)))
    if getattr(verify_input, "spec_steps", None) is not None:
        # SGLang bounds the accepted path by its draft steps; a context tree's copies run deeper than its head
        # rounds (``TreeServerOptions.draft_steps``), so the bound is the tree's depth
        verify_input.spec_steps = max(verify_input.spec_steps, state.step_depth)
    if drafter.guard is not None:
        try:
            _report_head_faults(drafter.guard)
        except Exception as error:  # a count: the batch's draft stands
            plugin_fault(HEAD_FAULTS, error, f"batch of {len(batch.reqs)}",
                         "drafted; its requests' non-finite head outputs since the last read not counted")
    return verify_input


def _make_ragged(state: WorkerState, verify_input, batch_size: int, ragged_graphs: bool) -> None:
    """Each request's verify covers its real tree (``ragged_verify``): the fillers unlinked from the verify input's
    tree and the step's lengths attached to it for the verify's forward; a dense step's too where the step's
    verify graphs are SGLang's ragged ones (``ragged_graphs``: they replay only a forward carrying its layout). A
    fault leaves the step dense (the inputs are every rank's, so under tensor parallelism every rank leaves it
    dense together)."""
    try:
        lengths = state.drafter.verify_lengths()
        width = verify_input.draft_token_num
        if lengths is None or len(lengths) != batch_size:
            return
        ragged = RaggedVerify.of([min(length, width) for length in lengths], width,
                                 verify_input.retrieve_next_token.device)
        if ragged.dense and not ragged_graphs:
            return
        links = unlink_fillers(verify_input.retrieve_next_token, verify_input.retrieve_next_sibling,
                               ragged.lengths_tensor())
    except Exception as error:
        plugin_fault(RAGGED, error, f"batch of {batch_size}", "verified at SGLang's width")
        return
    verify_input.retrieve_next_token, verify_input.retrieve_next_sibling = links
    setattr(verify_input, RAGGED_ATTRIBUTE, ragged)


def draft_forward_around(original, worker, forward_batch, *args, **kwargs):
    """The drafter's trees for the batch; a draft that raises verifies the filler tree for that batch instead. Under
    tensor parallelism the ranks agree first, so all fall back together."""
    state: WorkerState | None = state_of(worker)
    if state is not None and forward_batch.forward_mode.is_idle() and not state.drafter.uses_head:
        # DP attention's idle rank beside lookup trees: they run no head forward, so neither does it (SGLang's idle
        # draft runs the steps' head forwards, whose DP gathers would wait for ranks that never join)
        return None, None, None, None
    if state is None or forward_batch.forward_mode.is_idle():
        return original(worker, forward_batch, *args, **kwargs)
    faults = state.faults
    inject = faults is not None and faults.draft_due()
    error: Exception | None = None
    try:
        # injected before the draft on one rank; with peers once it ran (a rank that skipped the head's forward
        # would leave the others waiting in its all-reduce: see Peers)
        if inject and state.peers is None:
            raise InjectedFault(f"draft {faults.drafts} ({FAULT_ENV}={faults.draft_every})")
        drafted = _draft(original, worker, forward_batch, state, *args, **kwargs)
        if inject:
            raise InjectedFault(f"draft {faults.drafts} ({FAULT_ENV}={faults.draft_every}, once drafted)")
    except Exception as caught:  # one batch's draft must not take the scheduler down: it verifies a filler tree
        if capturing():  # a failed graph capture must fail, not record a filler tree
            raise
        error = caught
    if state.peers is not None and not capturing() and state.peers.any_rank(error is not None) and error is None:
        error = FaultOnAnotherRank("another tensor-parallel rank's draft of this batch faulted")
    if error is None:
        return drafted
    try:
        state.drafter.forget_proposal()  # nothing was proposed: the accept teaches the counts nothing
    except Exception as forget_error:  # the counts may learn from the filler's accept: trees, never the output
        accept_fault(OBSERVE, forget_error, forward_batch.batch_size, "its drafter kept the proposal the filler "
                                                                      "replaced")
    METRICS.record_draft_fault(type(error).__name__)
    log(f"draft fault, batch of {forward_batch.batch_size} verified without speculation "
        f"({type(error).__name__}: {error}; sglang_spec_draft_faults_total)")
    filler = state.filler if state.step_budget in (None, state.budget) else \
        filler_encoding(state.step_budget, state.width, worker.speculative_num_steps)  # the plan's smaller tree
    return filler_draft(filler, forward_batch.batch_size, forward_batch.spec_info.bonus_tokens.device)


def _draft(original, worker, forward_batch, state: WorkerState, *args, **kwargs):
    requests = state.draft_requests
    drafter = state.drafter
    if drafter.eager and requests is None:  # a draft graph capture: SGLang's loop fills it; eager trees never replay
        return original(worker, forward_batch, *args, **kwargs)
    if drafter.learns():
        _observe_accepted(drafter, state, forward_batch.batch_size)
    # the worker's draft steps, not ``state.steps``: a planned smaller tree's runtime state sets them for this step
    return drafter.draft(DraftCall(worker, forward_batch, requests, state.step_nodes, worker.speculative_num_steps,
                                   state.step_depth, lambda: original(worker, forward_batch, *args, **kwargs),
                                   state.request_budgets))


def _observe_accepted(drafter: ServedDrafter, state: WorkerState, batch_size: int) -> None:
    """The drafter learns what the last verified trees accepted; a fault there is an accept fault: its counts keep
    what they learnt before it (they shape trees, never the output) and this batch drafts."""
    # with tensor parallelism every rank builds the same trees from the same counts: a fault on one rank alone
    # would leave its counts behind the others' (and a fault half-way, part-taught), so all keep what they had
    before = None
    failed = False
    try:
        before = drafter.learnt() if state.peers is not None else None
        if state.faults is not None:
            state.faults.fire_accept(OBSERVE)
        drafter.observe_outcome()
    except Exception as error:
        failed = True
        accept_fault(OBSERVE, error, batch_size, "its drafter did not learn from the last accepted paths")
    if state.peers is None or not state.peers.any_rank(failed):
        return
    if not failed:
        accept_fault(OBSERVE, FaultOnAnotherRank("another tensor-parallel rank's drafter did not learn"),
                     batch_size, "its drafter did not learn from the last accepted paths, as on that rank")
    if before is not None:  # None: the fault came before this rank learnt anything
        try:
            drafter.restore(before)
        except Exception as error:
            accept_fault(OBSERVE, error, batch_size, "its drafter's counts not restored (its trees may differ "
                                                     "from the other ranks' until they agree again)")


def _report_head_faults(guard: HeadGuard) -> None:
    """Requests drafted from a non-finite head output since the last read: counted, one log line."""
    new = guard.new_faults(time.monotonic())
    if new:
        METRICS.record_draft_fault(HEAD_FAULT, new)
        log(f"draft fault, {new} request(s) whose head output was not finite verified without speculation "
            f"({HEAD_FAULT}; sglang_spec_draft_faults_total)")


# ---------------------------------------------------------------------------------------------- head forwards
def head_free(worker) -> bool:
    """The head's forwards (the draft extend over a prompt and over each step's accepted tokens, which fill its KV
    and give the next root's candidates) are skipped on a ``lookup`` server, whose trees never ask the head."""
    state: WorkerState | None = state_of(worker)
    return state is not None and not state.drafter.uses_head


def _stub_draft_input(worker, batch_size: int) -> dict:
    """The next draft input's head fields where the head did not run: zeros of the shapes SGLang's own stub for a
    skipped draft extend gives (``EAGLEWorkerV2._stub_skipped_draft_extend``); neither a lookup tree nor a plain
    step reads them."""
    from sglang.srt.speculative.eagle_utils import get_draft_recurrent_hidden_state_spec

    fields = {"topk_p": torch.zeros((batch_size, worker.topk), dtype=torch.float32, device=worker.device),
              "topk_index": torch.zeros((batch_size, worker.topk), dtype=torch.int64, device=worker.device)}
    hidden_size, hidden_dtype = get_draft_recurrent_hidden_state_spec(worker.draft_runner)
    if hidden_size is not None:
        fields["hidden_states"] = torch.zeros((batch_size, hidden_size), dtype=hidden_dtype, device=worker.device)
    return fields


def draft_extend_for_prefill_around(original, worker, batch, target_hidden_states, next_token_ids, *args, **kwargs):
    """A prefill's draft extend: the stub of its outputs where the head's pass is skipped (``head_free``); a fault
    there runs SGLang's draft extend (the head's pass: more work, the same output)."""
    try:
        if head_free(worker):
            from sglang.srt.speculative.eagle_info import EagleDraftInput

            return EagleDraftInput(bonus_tokens=next_token_ids, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1,
                                   **_stub_draft_input(worker, batch.seq_lens.shape[0]))
    except Exception as error:
        plugin_fault(HEAD_SKIP, error, f"batch of {len(batch.reqs)}", "the head's pass over it ran")
    return original(worker, batch, target_hidden_states, next_token_ids, *args, **kwargs)


def draft_extend_for_decode_around(original, worker, batch, batch_output, *args, **kwargs):
    """A decode step's draft extend: as the prefill's (its stub: the next draft input's head fields); a plain step
    of tree auto's with the head at rest (``StepPlanner.skip_head``) stubs it too, its tokens' head KV zeroed
    (``rest_head``). A rest is the group's decision: a fault in it still stubs (a rank that ran the head's pass
    alone would leave its peers' collectives unpaired)."""
    if head_resting(worker):
        try:
            rest_head(worker, batch)
        except Exception as error:
            plugin_fault(HEAD_SKIP, error, f"batch of {len(batch.reqs)}",
                         "its head KV left as it was (the head at rest)")
        _stub_next_draft_input(worker, batch, batch_output)
        return None
    try:
        if head_free(worker):
            _stub_next_draft_input(worker, batch, batch_output)
            return None
    except Exception as error:  # a field set before the fault is set again by SGLang's draft extend
        plugin_fault(HEAD_SKIP, error, f"batch of {len(batch.reqs)}", "the head's pass over it ran")
    try:
        rows = extend_logit_rows(worker, batch, batch_output)
    except Exception as error:
        plugin_fault(EXTEND_ROWS, error, f"batch of {len(batch.reqs)}", "its LM head ran over every row")
        rows = None
    if rows is None:
        return original(worker, batch, batch_output, *args, **kwargs)
    with _logits_at(worker.draft_runner, rows):
        return original(worker, batch, batch_output, *args, **kwargs)


def extend_logit_rows(worker, batch, batch_output) -> torch.Tensor | None:
    """[bs] the rows of a decode step's draft extend whose logits SGLang reads: each request's last accepted token
    (``r * width + accept_lens[r] - 1``, SGLang's own ``select_index``). The extend runs the head over the step's
    whole window (``width`` rows a request, for its graphs' fixed shapes) but reads one row's candidates a
    request, and its LM head is most of a row's work at a small hidden size: the plugin computes those rows'
    logits only. None (every row, as SGLang does) where that does not hold: no tree server's state, a plain step's
    window of one, a draft-extend graph (its replay selects the rows itself), DP attention (the forward pads its
    batch), a batch that returns logprobs (the processor reads every row for them), an idle batch."""
    state: WorkerState | None = state_of(worker)
    width = worker.speculative_num_draft_tokens
    if (state is None or width == 1 or worker.cuda_graph_runner_for_draft_extend is not None or state.dp_attention
            or batch.return_logprob or batch.forward_mode.is_idle()):
        return None
    accept_lens = batch_output.accept_lens
    starts = torch.arange(0, accept_lens.shape[0] * width, width, device=accept_lens.device)
    return starts + accept_lens.long() - 1


@contextlib.contextmanager
def _logits_at(runner, rows: torch.Tensor):
    """The draft runner's forward, for this extend only: its logits processor over ``rows`` alone (``LOGIT_ROWS``,
    through SGLang's own row selection), the logits then spread back to every row of the forward (zeros elsewhere,
    which SGLang's ``select_index`` never reads), so SGLang's eager extend selects them as it would the whole."""
    forward = runner.forward  # the class's (hooked) method, bound: shadowed by an instance attribute below

    def selected(forward_batch, *args, **kwargs):
        token = LOGIT_ROWS.set(rows)
        try:
            result = forward(forward_batch, *args, **kwargs)
        finally:
            LOGIT_ROWS.reset(token)
        output = result.logits_output
        output.next_token_logits = spread_rows(output.next_token_logits, rows, forward_batch.input_ids.shape[0])
        return result

    runner.forward = selected
    try:
        yield
    finally:
        del runner.forward


def _stub_next_draft_input(worker, batch, batch_output) -> None:
    # verify already set the bonus tokens, the one field a lookup draft or a plain step reads
    for name, value in _stub_draft_input(worker, batch.seq_lens.shape[0]).items():
        setattr(batch_output.next_draft_input, name, value)


def head_resting(worker) -> bool:
    """Whether this decode step is a plain step of tree auto's that leaves the head's draft extend out."""
    state: WorkerState | None = state_of(worker)
    return state is not None and state.auto is not None and state.auto.skip_head


def rest_head(worker, batch) -> None:
    """The head's KV of the tokens a plain step verified, zeroed (the draft extend it skips would have written
    them): one token a request, at position ``seq_lens`` (the step's verify token), in the slots the target
    wrote. SGLang's own skip (``EAGLEWorkerV2._stub_skipped_draft_extend``) leaves there whatever the slot held."""
    pool = batch.req_to_token_pool.req_to_token
    slots = pool[batch.req_pool_indices.long(), batch.seq_lens.long()]
    zero_kv(worker.draft_runner.token_to_kv_pool, slots)


# ---------------------------------------------------------------------------------------------- inside the loops
def select_top_k_tokens_around(original, i, topk_p, topk_index, hidden_states, scores, topk):
    """SGLang's own selection (chain, eagle), then every new beam's KV column gets its parent beam's history."""
    result = original(i, topk_p, topk_index, hidden_states, scores, topk)
    step = SGLANG_LOOP_STEP.get()
    if step is not None:
        keep_ancestry(step, i, result[3][2], topk)
    return result


def logits_metadata_after(result, cls, *args, **kwargs):
    """Inside the plugin's draft forward (``state.LOGIT_ROWS`` set): the logits processor computes the head over
    those rows only, through SGLang's own row selection (``draft_extend_select_index``, which it applies in decode
    mode too); its last hidden states are those rows' as well."""
    rows = LOGIT_ROWS.get()
    if rows is not None:
        result.draft_extend_select_index = rows
    return result
