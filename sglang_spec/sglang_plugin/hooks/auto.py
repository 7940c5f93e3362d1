"""Hooks of ``--speculative-tree-auto``: each decode step of the running batch is a tree step, a plain step (SGLang's
own 0-step path: the root alone verified, the head's KV kept warm by the draft extend) or a cold one (the
target's DECODE forward, SGLang's draft-extend stub), as ``batch_switch`` decides; every decode step is timed with
the tokens it emitted. A prefill whose requests join a batch that is cold by prediction skips the head's pass over
their prompts. A fault in the decision gives a plain step (exact whatever the switch)."""

from __future__ import annotations

import contextlib
import time

from sglang_spec.sglang_plugin.batch_switch import COLD, PLAIN, TREE, BatchSwitches
from sglang_spec.sglang_plugin.faults import AUTO, accept_fault
from sglang_spec.sglang_plugin.messages import log
from sglang_spec.sglang_plugin.state import WorkerState, is_cold, mark_cold, state_of
from sglang_spec.sglang_plugin.step_costs import measure_step_costs


def scheduler_run_batch_before(scheduler, batch, *args, **kwargs):
    """Before a prompt prefill, the size of the decode batch its requests will join (``WorkerState.joining``)."""
    state: WorkerState | None = state_of(scheduler.draft_worker) if scheduler.draft_worker is not None else None
    if state is None or not state.options.auto:
        return None
    joins = None
    if batch.forward_mode.name == "EXTEND":  # a prompt prefill (not mixed with decode rows, not split)
        joins = scheduler.running_batch.batch_size() + batch.batch_size() + len(scheduler.waiting_queue)
        joins = min(joins, scheduler.max_running_requests or joins)
    state.joining = joins
    return None


def forward_batch_generation_around(original, worker, batch, *args, **kwargs):
    """A decode batch: the switch's kind of step, timed; a prefill: admitted warm or cold (``_admit``)."""
    state: WorkerState | None = state_of(worker)
    if state is None or not state.options.auto or batch.forward_mode.is_idle():
        return original(worker, batch, *args, **kwargs)
    if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
        return _admit(original, state, worker, batch, *args, **kwargs)
    if state.auto is None:
        state.auto = _start_switches(worker)
    switches = state.auto
    size = len(batch.reqs)
    try:
        warm = sum(1 for request in batch.reqs if not is_cold(request))
        kind = switches.decide(size, [request.rid for request in batch.reqs], warm=warm)
    except Exception as error:  # SGLang's own plain step (the head's KV kept warm): exact whatever the switch
        accept_fault(AUTO, error, size, "decoded by a plain step")
        kind = PLAIN
    start = time.perf_counter()
    if kind != TREE:
        with _zero_steps(worker, state, cold=kind == COLD):
            output = original(worker, batch, *args, **kwargs)
    else:
        output = original(worker, batch, *args, **kwargs)
    try:
        _observe_step(switches, batch, kind, output, start, state)
    except Exception as error:  # the step's output stands; the switch learns nothing from it
        accept_fault(AUTO, error, size, "decoded; tree auto did not learn from its time")
    return output


def _admit(original, state: WorkerState, worker, batch, *args, **kwargs):
    """A prefill under tree auto: where the decode batch its requests join (``WorkerState.joining``) is cold by
    prediction (``BatchSwitches.admit``), it runs without the head's draft extend (SGLang's stub of the next draft
    input, as for a ``lookup`` server) and its requests are cold from the start. Only a prompt prefill (EXTEND: no
    decode rows mixed in, see ``scheduler_run_batch_before``) goes cold; a later chunk of a cold prompt may run
    the head again, the request stays cold."""
    switches = state.auto
    joins = state.joining
    cold = False
    if switches is not None and joins is not None:
        try:
            cold = switches.admit(len(batch.reqs), joins)
        except Exception as error:  # the head's pass runs: warm, as without tree auto
            accept_fault(AUTO, error, len(batch.reqs), "prefilled with the head's pass")
    if not cold:
        return original(worker, batch, *args, **kwargs)
    assert switches is not None and joins is not None
    state.head_skipped = True
    try:
        output = original(worker, batch, *args, **kwargs)
    finally:
        state.head_skipped = False
    for request in batch.reqs:  # no head KV for the prompt: its tree steps teach the accept length nothing
        mark_cold(request)
    if switches.cold_admissions == len(batch.reqs):
        log(f"tree auto: prompts joining a batch of {joins} skip the head's pass (cold: trees predicted at "
            f"{switches.predicted_speedup(joins, floor=True):.2f}x there)")
    return output


def _observe_step(switches: BatchSwitches, batch, kind: str, output, start: float, state: WorkerState) -> None:
    """Tree auto's bookkeeping of a decoded step: its time per emitted token, the cold marks, and (a tree step
    of a host context server) the prices of its head levels."""
    size = len(batch.reqs)
    accept_lens = output.accept_lens.tolist()  # reads the step's result: the time below is the step's own
    seconds = time.perf_counter() - start
    level_costs = getattr(state.drafter, "level_costs", None)
    if kind == TREE and level_costs is not None:
        _price_levels(state.drafter, size, seconds)
    rids = [request.rid for request in batch.reqs]
    warm = {rid: accept_lens[index] for index, (rid, request) in enumerate(zip(rids, batch.reqs))
            if not is_cold(request)}
    message = switches.observe(size, kind != TREE, seconds, sum(accept_lens), rids=rids, request_tokens=warm)
    if kind == COLD:
        for request in batch.reqs:  # its head now lacks KV for this position: its tree steps teach nothing
            mark_cold(request)
    if message is not None:
        log(message)


def _price_levels(drafter, size: int, seconds: float) -> None:
    """A tree step's time and its head rounds' into the host drafter's level prices (logged once, when trees
    first leave a level out)."""
    costs = drafter.level_costs
    priced_out = drafter.priced_out
    costs.observe(size, seconds, drafter.rounds, drafter.rounds_seconds)
    if priced_out and not costs.logged:
        costs.logged = True
        log(f"tree auto: head levels priced at batch {size} ({costs.describe(size)}): trees leave a level out "
            f"where its predicted gain does not pay ({priced_out} so far)")


def _start_switches(worker) -> BatchSwitches:
    """Tree auto's state, with the target's verify forward timed per batch size (before the first decode step)."""
    start = time.perf_counter()
    try:
        costs = measure_step_costs(worker)
    except Exception as error:  # a backend whose dummy forward fails: the switch still measures served steps
        log(f"tree auto: start-up costs not measured ({type(error).__name__}: {error}); deciding from served steps")
        return BatchSwitches()
    log(f"tree auto: verify forward of {costs.tokens} tokens a request over 1, by batch size: {costs.describe()} "
        f"(measured in {time.perf_counter() - start:.1f} s)")
    return BatchSwitches(costs=costs)


@contextlib.contextmanager
def _zero_steps(worker, state: WorkerState, cold: bool = False):
    """SGLang's drafting-disabled state for one step: 0 draft steps, 1 verified token (its trivial verify input),
    on the worker and its draft worker, restored after; the target's forward runs in DECODE mode (``_as_decode``:
    a one-token TARGET_VERIFY costs more than a decode step). Warm, its hidden states feed the draft extend as a
    verify's would; ``cold``: the draft extend is skipped (``WorkerState.head_skipped``: the stub of the next draft
    input that SGLang's SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND gives every 0-step)."""
    draft = worker.draft_worker
    saved = (worker.speculative_num_steps, worker.speculative_num_draft_tokens, draft.speculative_num_steps,
             draft.speculative_num_draft_tokens)
    worker.speculative_num_steps = draft.speculative_num_steps = 0
    worker.speculative_num_draft_tokens = draft.speculative_num_draft_tokens = 1
    target = worker.target_worker
    # instance attributes over the methods for this step; deleting them shows the methods again
    forward = target.forward_batch_generation
    target.forward_batch_generation = lambda **kwargs: forward(**_as_decode(keep_hidden=not cold, **kwargs))
    skipped, state.head_skipped = state.head_skipped, cold
    try:
        yield
    finally:
        (worker.speculative_num_steps, worker.speculative_num_draft_tokens, draft.speculative_num_steps,
         draft.speculative_num_draft_tokens) = saved
        del target.forward_batch_generation
        state.head_skipped = skipped


def _as_decode(forward_batch, is_verify: bool = False, keep_hidden: bool = True, **kwargs) -> dict:
    """A plain step's target forward as SGLang's DECODE forward, not a one-token TARGET_VERIFY: the same token
    (the previous bonus token, at position ``seq_len``) and KV slot, but the decode attention path (no tree
    mask, no extend kernels). DECODE counts the new token in ``seq_lens``; verify counts it through its
    draft-token count. The logits come out the same, one row a request, and so do the hidden states with
    ``keep_hidden`` (the capture mode verify asked for: the draft extend's input); without it none are captured
    (a cold step's draft extend is stubbed)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

    if is_verify and forward_batch.forward_mode.is_target_verify():
        size = forward_batch.batch_size
        forward_batch.forward_mode = ForwardMode.DECODE
        forward_batch.spec_info = None
        if not keep_hidden:
            forward_batch.capture_hidden_mode = CaptureHiddenMode.NULL
        forward_batch.seq_lens = forward_batch.seq_lens + 1
        if forward_batch.seq_lens_cpu is not None:
            forward_batch.seq_lens_cpu = forward_batch.seq_lens_cpu + 1
        if forward_batch.seq_lens_sum is not None:
            forward_batch.seq_lens_sum += size
    return dict(kwargs, forward_batch=forward_batch, is_verify=is_verify)
