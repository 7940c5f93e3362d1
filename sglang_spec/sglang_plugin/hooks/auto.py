"""Hooks of ``--speculative-tree-auto``: before each decode step the planner chooses how many tokens every request
verifies (``step_planner``), the ranks of the group agreeing on its inputs; the step runs at that size (1: SGLang's
own plain step, the target's DECODE forward with the head's draft extend kept warm, or at rest after a long run of
plain steps; the full tree: as configured;
between: the drafter grows and SGLang verifies a smaller tree) and is timed with the tokens it emitted. A fault in
the plan gives a plain step (exact whatever the planner)."""

from __future__ import annotations

import contextlib
import os
import time

from sglang_spec.planner import SizeTable, StepPlan
from sglang_spec.sglang_plugin.drafters.beams import supports_row_permutation
from sglang_spec.sglang_plugin.faults import AUTO, accept_fault
from sglang_spec.sglang_plugin.messages import log
from sglang_spec.sglang_plugin.metrics import PLANS
from sglang_spec.sglang_plugin.options import DEFAULT_HEAD_REST
from sglang_spec.sglang_plugin.peers import dp_attention
from sglang_spec.sglang_plugin.ragged_verify import decide as decide_ragged
from sglang_spec.sglang_plugin.state import WorkerState, state_of
from sglang_spec.sglang_plugin.step_costs import measure_step_costs
from sglang_spec.sglang_plugin.step_planner import PLAN_LOG_ENV, StepPlanner, default_sizes
from sglang_spec.sglang_plugin.verify_shapes import VerifyShapes


def forward_batch_generation_around(original, worker, batch, *args, **kwargs):
    """A decode batch: the planner's step, run and timed; any other batch: as it is (the group's ranks still meet
    once, so their agreements pair up), an idle rank of a decode step (DP attention) at the size the group's plan
    takes."""
    state: WorkerState | None = state_of(worker)
    if state is None or not state.options.auto:
        return original(worker, batch, *args, **kwargs)
    if state.auto is None:
        state.auto = _start_planner(worker, state)
    planner = state.auto
    decode = not (batch.forward_mode.is_idle() or batch.forward_mode.is_extend() or batch.is_extend_in_batch)
    if not decode:
        if state.plan_group is None:
            return original(worker, batch, *args, **kwargs)
        table = state.plan_group.agree(_empty_table(planner))
        if not (batch.forward_mode.is_idle() and not batch.is_extend_in_batch):
            return original(worker, batch, *args, **kwargs)
        # DP attention's idle rank beside decoding ones: the group's size, so its head forwards pair up with theirs
        if not planner.idle_steps:
            log("tree auto: a DP attention rank with no request steps at its group's verify sizes")
        planner.idle_steps += 1
        with _verify_size(worker, state, planner.size_for(table)):
            return original(worker, batch, *args, **kwargs)
    rids = [request.rid for request in batch.reqs]
    _refresh_predictions(planner, state, batch.reqs)
    plan = _plan(planner, state, rids)
    start = time.perf_counter()
    with _verify_size(worker, state, plan.tokens, plan.nodes if planner.ragged and not plan.plain else None):
        output = original(worker, batch, *args, **kwargs)
    try:
        _observe_step(planner, state, plan, rids, output, start)
    except Exception as error:  # the step's output stands; the planner learns nothing from it
        accept_fault(AUTO, error, len(rids), "decoded; tree auto did not learn from its time")
    return output


def _refresh_predictions(planner: StepPlanner, state: WorkerState, requests: list) -> None:
    """The drafter's estimates (no forward) for the requests whose prediction is missing or oldest; a fault
    leaves the predictions as they were."""
    if not planner.ranked:
        return
    try:
        stale = set(planner.stale([request.rid for request in requests]))
        planner.learn_reach(state.drafter.estimate_reach([request for request in requests if request.rid in stale],
                                                         planner.full - 1))
    except Exception as error:
        accept_fault(AUTO, error, len(requests), "planned from the predictions it had")


def _plan(planner: StepPlanner, state: WorkerState, rids: list[str]) -> StepPlan:
    """The step's plan, agreed by the group. A fault in the plan (this rank's) is a plain step's table from this
    rank, so the group still meets once and every rank takes the same step."""
    try:
        table = planner.table(rids)
    except Exception as error:
        accept_fault(AUTO, error, len(rids), "its plan priced without this rank's inputs")
        table = _empty_table(planner)
    if state.plan_group is not None:
        table = state.plan_group.agree(table)
    try:
        if planner.ragged:
            plan = planner.ragged_plan(table, rids)
            nodes = plan.nodes if state.plan_group is None else state.plan_group.least(plan.nodes)
            return planner.take_ragged(table, plan, nodes)
        return planner.choose(table, len(rids))
    except Exception as error:  # SGLang's own plain step: exact whatever the plan
        # choose reads the agreed table and the launch's cap alone, the same on every rank: a fault in it is
        # every rank's, so this plain step is the group's too (and so is its part in the head's rest)
        accept_fault(AUTO, error, len(rids), "decoded by a plain step")
        planner.take(1)
        return StepPlan(1, float(len(rids)), 0.0, (0,) * len(rids))


def _empty_table(planner: StepPlanner) -> SizeTable:
    """What a rank with no decode step (or a failed plan) brings to the group's agreement: nothing."""
    zeros = (0.0,) * len(planner.sizes)
    return SizeTable(planner.sizes, zeros, zeros)


def _observe_step(planner: StepPlanner, state: WorkerState, plan: StepPlan, rids: list[str], output,
                  start: float) -> None:
    """The planner's bookkeeping of a decoded step: its time and tokens, the reach of the trees just drafted, a
    host drafter's head-level prices, the metrics."""
    accept_lens = output.accept_lens.tolist()  # reads the step's result: the time below is the step's own
    seconds = time.perf_counter() - start
    rounds_seconds = state.drafter.rounds_seconds
    if not plan.plain and state.drafter.level_costs is not None and state.plan_group is not None:
        # level prices shape the trees, and the ranks of a group verify one tree a request: they price from the
        # same times, the group's slowest (first, so a later fault on one rank cannot leave the others waiting)
        seconds, rounds_seconds = state.plan_group.slowest(seconds, rounds_seconds)
    # a new request's context index is built once: not a cost the step's size repeats
    setup = 0.0 if plan.plain else state.drafter.setup_seconds
    planner.observe(plan, rids, seconds - setup, accept_lens,
                    verified_tokens=None if plan.plain or not planner.ragged else state.verified_tokens,
                    drafting_seconds=0.0 if plan.plain else rounds_seconds)
    if not plan.plain:
        planner.learn_reach(state.drafter.drafted_reach())
        _price_levels(state, len(rids), seconds, rounds_seconds)
    PLANS.record(plan.tokens, plan.verify_tokens(planner.ragged), plan.predicted_seconds, seconds,
                 head_rested=planner.skip_head,
                 head_warmup=planner.head_warmup)
    if planner.log_path is not None:
        planner.write_log(plan, rids, seconds, accept_lens)


def _price_levels(state: WorkerState, size: int, seconds: float, rounds_seconds: float) -> None:
    """A tree step's time and its head rounds' into a host drafter's level prices (logged once, when trees first
    leave a level out)."""
    costs = state.drafter.level_costs
    if costs is None:
        return
    priced_out = state.drafter.priced_out
    costs.observe(size, seconds, state.drafter.rounds, rounds_seconds)
    if priced_out and not costs.logged:
        costs.logged = True
        log(f"tree auto: head levels priced at batch {size} ({costs.describe(size)}): trees leave a level out "
            f"where its predicted gain does not pay ({priced_out} so far)")


def _start_planner(worker, state: WorkerState) -> StepPlanner:
    """The planner, with the target's verify forward timed per batch size and verify size (before the first
    step)."""
    full = worker.speculative_num_draft_tokens
    ranked = state.drafter.reports_reach
    graphs = worker.target_worker.model_runner.decode_cuda_graph_runner is not None
    sizes = state.options.verify_sizes or default_sizes(full, graphs, ranked)
    # "1,N" is the whole batch on or off (docs): shares per request only where the plan may take sizes between
    planner = StepPlanner(None, sizes, full, state.options.step_cap, width=state.width, ranked=ranked,
                          ragged=decide_ragged(state, worker.draft_worker) and len(sizes) > 2,
                          head_rest=_head_rest(worker, state), prior=state.drafter.prior_reach(full - 1),
                          log_path=os.environ.get(PLAN_LOG_ENV) or None)
    # a head swapped in place (adapt): the planner's acceptance follows the head served, from the drafter's prior
    state.head_swapped.append(lambda swap: planner.head_swapped(state.drafter.prior_reach(full - 1)))
    start = time.perf_counter()
    full_runner = worker.target_worker.model_runner.decode_cuda_graph_runner  # the full tree's, captured at launch
    if planner.ragged and getattr(full_runner, "ragged_verify_mode", False):  # ragged steps replay its tiers
        planner.tiers = tuple(full_runner.capture_num_tokens)
        log(f"tree auto: ragged steps run at the full width on its ragged verify graphs, each priced at its tier of "
            f"verify tokens ({', '.join(map(str, planner.tiers))})")
    # the sizes a step runs at get SGLang's runtime state (and graphs); the others only price (the eager runner's
    # forward is timed at each, ``step_costs``)
    state.shapes = VerifyShapes.build(worker, planner.ragged_widths if planner.ragged else planner.sizes)
    try:
        planner.costs = measure_step_costs(worker, planner.sizes)
    except Exception as error:  # a backend whose dummy forward fails: the planner prices sizes from served steps
        log(f"tree auto: start-up costs not measured ({type(error).__name__}: {error}); pricing from served steps")
        return planner
    log(f"tree auto: verify sizes {', '.join(map(str, planner.sizes))} ({len(state.shapes.states)} runtime states"
        f"{', graphs captured' if state.shapes.graphs else ''}); the largest over a plain step's forward, by batch "
        f"size: {planner.costs.describe()} (measured in {time.perf_counter() - start:.1f} s)")
    return planner


def _head_rest(worker, state: WorkerState) -> int | None:
    """Plain steps in a row after which plain steps leave the head's draft extend out (``step_planner``, the head at
    rest); None where the head never rests: a drafter that never runs it, DP attention (a rank may prefill, running
    the head, while another decodes; the option is refused there, its default off), a draft pool whose slots cannot
    be zeroed one token at a time (said in one line)."""
    rest = state.options.head_rest
    if not state.drafter.uses_head or rest == 0 or (rest is None and dp_attention()):
        return None
    if not supports_row_permutation(worker.draft_worker.draft_runner.token_to_kv_pool):
        log("tree auto: the head runs every plain step (its draft KV pool is not one token a row, so the tokens it "
            "skipped could not be zeroed)")
        return None
    return DEFAULT_HEAD_REST if rest is None else rest


@contextlib.contextmanager
def _verify_size(worker, state: WorkerState, tokens: int, budgets: tuple[int, ...] | None = None):
    """The step verifies ``tokens`` a request under that size's SGLang runtime state (``verify_shapes``): the full
    tree as configured, SGLang's own plain step (1), or a smaller tree with the drafter's budget to match
    (``WorkerState.step_budget``), for this step only; a ragged plan's ``budgets`` cap each request's tree
    (``WorkerState.request_budgets``). A plain step without captured graphs runs the target's DECODE forward
    (``_as_decode``: a one-token TARGET_VERIFY costs more than a decode step)."""
    shapes = state.shapes
    state.request_budgets = budgets
    try:
        if shapes is None or tokens == shapes.full:
            yield
            return
        saved = state.step_budget
        state.step_budget = tokens - 1 if tokens > 1 else None
        try:
            with shapes.step(tokens), (_decode_forward(worker) if tokens == 1 and not shapes.graphs
                                       else contextlib.nullcontext()):
                yield
        finally:
            state.step_budget = saved
    finally:
        state.request_budgets = None


@contextlib.contextmanager
def _decode_forward(worker):
    """A plain step's target forward as SGLang's DECODE forward (``_as_decode``), for this step only. Its hidden
    states feed the draft extend as a verify's would, so the head's KV stays warm for the next tree."""
    target = worker.target_worker
    # an instance attribute over the method for this step; deleting it shows the method again
    forward = target.forward_batch_generation
    target.forward_batch_generation = lambda **kwargs: forward(**_as_decode(**kwargs))
    try:
        yield
    finally:
        del target.forward_batch_generation


def _as_decode(forward_batch, is_verify: bool = False, **kwargs) -> dict:
    """A plain step's target forward as SGLang's DECODE forward, not a one-token TARGET_VERIFY: the same token
    (the previous bonus token, at position ``seq_len``) and KV slot, but the decode attention path (no tree
    mask, no extend kernels). DECODE counts the new token in ``seq_lens``; verify counts it through its
    draft-token count. The logits come out the same, one row a request, and so do the hidden states (the capture
    mode verify asked for: the draft extend's input)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    if is_verify and forward_batch.forward_mode.is_target_verify():
        size = forward_batch.batch_size
        forward_batch.forward_mode = ForwardMode.DECODE
        forward_batch.spec_info = None
        forward_batch.seq_lens = forward_batch.seq_lens + 1
        if forward_batch.seq_lens_cpu is not None:
            forward_batch.seq_lens_cpu = forward_batch.seq_lens_cpu + 1
        if forward_batch.seq_lens_sum is not None:
            forward_batch.seq_lens_sum += size
    return dict(kwargs, forward_batch=forward_batch, is_verify=is_verify)
