"""Faults inside the plugin's accept fail safe, hook by hook, with SGLang's objects stood in: the fused accept's
batch goes to SGLang's eagle_sample, a KV commit stopped half way is finished exactly, bookkeeping (the rank
counts, the per-request acceptance counts, tree auto's switch) is skipped while the batch's result stands; each
fault counted and logged in one line, and re-raised while a CUDA graph is being captured.

The server path, with faults injected through launch_server, is ``tests/sglang_server/test_accept_faults.py``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from doubles import plugin_worker_state
from helpers import random_tree, targets_following_drafts
from sglang_spec.sglang_plugin import faults as faults_module
from sglang_spec.sglang_plugin.faults import (ACCEPT, ACCEPT_FAULT_ENV, AUTO, COMMIT, COUNTS, PENALTIES, RECORD,
                                              AcceptFaults, FaultInjection, InjectedFault)
from sglang_spec.sglang_plugin.hooks import accept as hooks
from sglang_spec.sglang_plugin.hooks import auto as auto_hooks
from sglang_spec.sglang_plugin.state import VERIFY_STEP, VerifyStep, attach
from sglang_spec.sglang_plugin.fused_accept import FusedAccept
from sglang_spec.sglang_plugin.metrics import AcceptanceMetrics
from sglang_spec.tree import encode_sglang_verify

pytestmark = pytest.mark.sglang

VOCAB = 30


@pytest.fixture
def metrics(monkeypatch, capsys):
    counted = AcceptanceMetrics()
    monkeypatch.setattr(faults_module, "METRICS", counted)
    monkeypatch.setattr(hooks, "METRICS", counted)
    return counted


def fault_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "accept fault" in line]


def test_injected_faults_arm_one_stage_every_nth_step_in_turn():
    faults = AcceptFaults(2, (ACCEPT, COMMIT, RECORD))
    raised = []
    for _ in range(8):
        faults.arm()
        for stage in (ACCEPT, COMMIT, RECORD):
            try:
                faults.fire(stage)
            except InjectedFault:
                raised.append((faults.steps, stage))
    assert raised == [(2, ACCEPT), (4, COMMIT), (6, RECORD), (8, ACCEPT)]
    idle = AcceptFaults(0, (ACCEPT,))
    idle.arm()
    idle.fire(ACCEPT)  # never armed


def test_a_bad_accept_fault_setting_stops_the_launch_in_one_line(monkeypatch):
    monkeypatch.setenv(ACCEPT_FAULT_ENV, "often")
    with pytest.raises(SystemExit, match=f"error: {ACCEPT_FAULT_ENV}='often': give a whole number n"):
        FaultInjection().arm_accept(0, (ACCEPT,))
    monkeypatch.setenv(ACCEPT_FAULT_ENV, "4")
    injection = FaultInjection()
    injection.arm_accept(0, (ACCEPT,))
    assert injection.accept is not None and injection.accept.every == 4


def greedy_batch(seed: int = 3, batch: int = 3, nodes: int = 9, depth: int = 4):
    """A greedy verify batch in SGLang's layout: (verify_input, batch, logits_output)."""
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, nodes, 3, depth, vocab_size=VOCAB) for _ in range(batch)]
    meta = encode_sglang_verify(trees, [depth + 1] * batch)
    target = targets_following_drafts(rng, trees, nodes, accept_rate=0.9, vocab_size=VOCAB)
    logits = torch.nn.functional.one_hot(target.reshape(-1), VOCAB).float() * 5
    verify_input = SimpleNamespace(draft_token=meta.draft_tokens, draft_token_num=nodes,
                                   retrieve_next_token=meta.retrieve_next_token,
                                   retrieve_next_sibling=meta.retrieve_next_sibling)
    info = SimpleNamespace(is_all_greedy=True, acc_additive_penalties=None, acc_scaling_penalties=None,
                           logit_bias=None, has_watermark_candidates=False, need_top_k_sampling=False,
                           need_top_p_sampling=False, need_min_p_sampling=False)
    schedule_batch = SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: False), reqs=[None] * batch,
                                     req_pool_indices=torch.arange(batch), seq_lens=torch.full((batch,), 7),
                                     sampling_info=info, device="cpu")
    return verify_input, schedule_batch, SimpleNamespace(next_token_logits=logits)


@pytest.fixture
def spec(monkeypatch, sglang_with_plugin):
    from sglang.srt import runtime_context

    monkeypatch.setattr(runtime_context, "get_spec", lambda: SimpleNamespace(
        speculative_use_rejection_sampling=False, speculative_accept_threshold_single=1.0,
        speculative_accept_threshold_acc=1.0))


def test_a_fused_accept_fault_hands_the_batch_to_sglangs_eagle_sample(spec, metrics, capsys):
    """The fault fires with the fused outputs written (the walk's buffers): SGLang's accept serves the batch, from
    the same logits, and the worker commits its KV by SGLang's move (step.accepted stays False)."""
    verify_input, batch, logits_output = greedy_batch()
    fused = FusedAccept(9, 4, "cpu", metrics)
    sglang_calls = []

    def sglang_eagle_sample(*args, **kwargs):
        sglang_calls.append(args)
        return "sglang's accept"

    faults = AcceptFaults(2, (ACCEPT,))
    outcomes = []
    for _ in range(2):  # step 1: nothing armed, the fused accept serves it; step 2: the fault
        faults.arm()
        step = VerifyStep(plugin_worker_state(fused=fused, faults=FaultInjection(accept=faults)))
        token = VERIFY_STEP.set(step)
        try:
            outcomes.append((hooks._eagle_sample(sglang_eagle_sample, verify_input, batch, logits_output),
                             step.accepted))
        finally:
            VERIFY_STEP.reset(token)
    (fused_result, fused_accepted), (fallback_result, fallback_accepted) = outcomes
    assert fused_accepted and int(fused_result[1].max()) >= 2  # the fused accept walked the trees
    assert fallback_result == "sglang's accept" and len(sglang_calls) == 1 and not fallback_accepted
    assert fused.counts == {"fused": 1, "fault": 1} and metrics.accept_faults == {(ACCEPT, "InjectedFault"): 1}
    lines = fault_lines(capsys)
    assert len(lines) == 1 and "accept fault in accept, batch of 3: accepted by SGLang's eagle_sample" in lines[0]


class MovingPool:
    """K and V rows of ``layers`` layers in SGLang's slot-major MHA layout: ``size + page_size`` rows a buffer (the
    shape ``drafters.beams.supports_row_permutation`` checks)."""

    def __init__(self, slots: int, layers: int = 3) -> None:
        self.size, self.page_size = slots - 1, 1
        generator = torch.Generator().manual_seed(slots)
        self.k_buffer = [torch.randn(slots, 2, 3, generator=generator) for _ in range(layers)]
        self.v_buffer = [torch.randn(slots, 2, 3, generator=generator) for _ in range(layers)]

    def rows(self) -> list[torch.Tensor]:
        return [buffer.clone() for buffer in self.k_buffer + self.v_buffer]


def test_a_kv_commit_fault_half_way_is_finished_exactly(metrics, capsys):
    """A fault after the first of six layer buffers moved: the rest are moved by torch, none twice, and the pool is
    what an uninterrupted commit leaves; SGLang's own move is not called (it would move the first buffer again)."""
    batch_size, nodes = 2, 6
    accept_index = torch.tensor([[0, 2, 5], [6, 7, -1]], dtype=torch.int32)
    accept_lens = torch.tensor([3, 2], dtype=torch.int32)
    out_cache_loc = torch.tensor([20, 3, 11, 7, 15, 9, 4, 18, 2, 13, 6, 10])
    expected = MovingPool(24)
    FusedAccept.commit_kv(expected, out_cache_loc, accept_index, accept_lens, nodes)
    pool = MovingPool(24)
    assert not all(torch.equal(a, b) for a, b in zip(pool.rows(), expected.rows()))
    faults = AcceptFaults(1, (COMMIT,))
    faults.arm()
    step = VerifyStep(plugin_worker_state(fused=FusedAccept(nodes, 2, "cpu", metrics),
                                          faults=FaultInjection(accept=faults)), accepted=True)
    schedule_batch = SimpleNamespace(seq_lens=torch.tensor([5, 8]), out_cache_loc=out_cache_loc)
    allocator = SimpleNamespace(get_kvcache=lambda: pool)

    def sglang_move(*args):
        raise AssertionError("SGLang's move ran after the kernel had moved a buffer")

    token = VERIFY_STEP.set(step)
    try:
        hooks.move_accept_tokens_around(sglang_move, schedule_batch, accept_index, accept_lens - 1, allocator)
    finally:
        VERIFY_STEP.reset(token)
    assert all(torch.equal(a, b) for a, b in zip(pool.rows(), expected.rows()))
    assert metrics.accept_faults == {(COMMIT, "InjectedFault"): 1}
    lines = fault_lines(capsys)
    assert len(lines) == 1 and "by the kernel in 1 of 6 layer buffers, by torch in the rest" in lines[0]


def test_a_plain_steps_accepted_kv_is_left_where_it_is():
    """One verified slot a request (a plain step): the accepted token is each window's root, so the commit would
    copy every row onto itself (checked with the plugin's own commit); neither it nor SGLang's move runs. Two slots a
    request: the move runs."""
    out_cache_loc = torch.tensor([20, 3, 11])
    accept_index = torch.tensor([[0], [1], [2]], dtype=torch.int32)
    accept_lens = torch.ones(3, dtype=torch.int32)
    pool, moved = MovingPool(24), MovingPool(24)
    FusedAccept.commit_kv(moved, out_cache_loc, accept_index, accept_lens, 1)
    assert all(torch.equal(a, b) for a, b in zip(pool.rows(), moved.rows()))
    calls = []
    allocator = SimpleNamespace(get_kvcache=lambda: pool)
    plain = SimpleNamespace(seq_lens=torch.tensor([5, 8, 2]), out_cache_loc=out_cache_loc)
    hooks.move_accept_tokens_around(lambda *args: calls.append(args), plain, accept_index, accept_lens - 1, allocator)
    assert calls == []
    tree = SimpleNamespace(seq_lens=torch.tensor([5, 8, 2]), out_cache_loc=torch.arange(6))
    hooks.move_accept_tokens_around(lambda *args: calls.append(args), tree, accept_index * 2, accept_lens - 1,
                                    allocator)
    assert len(calls) == 1


def test_a_fault_in_the_bookkeeping_after_the_accept_leaves_the_result(monkeypatch, metrics, capsys):
    """The rank counts raise after SGLang's accept: the accept's outputs are returned as they were."""
    verify_input, batch, logits_output = greedy_batch()
    accepted = (torch.zeros(27, dtype=torch.int32), torch.ones(3, dtype=torch.int32),
                torch.tensor([[0, -1], [9, -1], [18, -1]], dtype=torch.int32))

    class BrokenRanks:
        enabled = True

        def record(self, *args):
            raise ValueError("rank counts")

    monkeypatch.setattr(hooks, "RANKS", BrokenRanks())
    token = VERIFY_STEP.set(VerifyStep(plugin_worker_state()))
    try:
        result = hooks.eagle_sample_around(lambda *args, **kwargs: accepted, verify_input, batch, logits_output)
    finally:
        VERIFY_STEP.reset(token)
    assert result is accepted
    assert metrics.accept_faults == {(RECORD, "ValueError"): 1}
    assert len(fault_lines(capsys)) == 1


def test_a_fault_in_the_per_node_penalties_leaves_the_batch_to_sglangs_relaxed_ones(monkeypatch, metrics, capsys):
    """The per-node penalties raise while being computed (on the host, before the logits are touched): SGLang's
    eagle_sample runs on the logits as they were, with its own accumulated penalties in place."""
    verify_input, batch, logits_output = greedy_batch()
    additive = torch.zeros(3, VOCAB)
    batch.sampling_info.acc_additive_penalties = additive
    logits = logits_output.next_token_logits.clone()
    seen = []

    def sglang_eagle_sample(verify_input, batch, logits_output, *args, **kwargs):
        seen.append((batch.sampling_info.acc_additive_penalties, logits_output.next_token_logits.clone()))
        return "sglang's accept"

    def broken(*args, **kwargs):
        raise IndexError("a node past the tree")

    monkeypatch.setattr(hooks, "tree_penalties", broken)
    requests = [SimpleNamespace(sampling_params=SimpleNamespace(frequency_penalty=0.5, presence_penalty=0.0,
                                                                repetition_penalty=1.0, min_new_tokens=0),
                                output_ids=[1, 2]) for _ in range(3)]
    batch.reqs = requests
    token = VERIFY_STEP.set(VerifyStep(plugin_worker_state()))
    try:
        assert hooks._with_exact_penalties(sglang_eagle_sample, verify_input, batch, logits_output) == \
            "sglang's accept"
    finally:
        VERIFY_STEP.reset(token)
    (penalties, sampled_logits), = seen
    assert penalties is additive and torch.equal(sampled_logits, logits)
    assert metrics.accept_faults == {(PENALTIES, "IndexError"): 1}
    lines = fault_lines(capsys)
    assert len(lines) == 1 and "accept fault in penalties, batch of 3: penalised by SGLang's relaxed" in lines[0]


def test_a_fault_in_the_acceptance_counts_leaves_the_request(monkeypatch, metrics, capsys, sglang_with_plugin):
    from sglang.srt.managers.schedule_batch import Req

    monkeypatch.setattr(metrics, "record", lambda drafts: 1 / 0)
    request = SimpleNamespace(spec_correct_drafts_histogram=[])
    Req.update_spec_correct_drafts_histogram(request, 2)
    assert request.spec_correct_drafts_histogram == [0, 0, 1]
    assert metrics.accept_faults == {(COUNTS, "ZeroDivisionError"): 1} and len(fault_lines(capsys)) == 1


def test_a_fault_while_a_cuda_graph_is_captured_still_raises(monkeypatch, metrics):
    monkeypatch.setattr(faults_module, "capturing", lambda: True)
    with pytest.raises(InjectedFault):
        try:
            raise InjectedFault("in capture")
        except InjectedFault as error:
            faults_module.accept_fault(ACCEPT, error, 1, "unused")
    assert not metrics.accept_faults


class AutoWorker:
    """EAGLEWorkerV2 as --speculative-tree-auto's hook reads it: the step count and verify-token count during the
    step tell a plain step (0 draft steps, SGLang's own path) from a smaller tree and the full one."""

    def __init__(self, planner) -> None:
        from sglang_spec.sglang_plugin.options import TreeServerOptions
        from sglang_spec.sglang_plugin.verify_shapes import VerifyShapes, level_steps

        self.state = attach(self, plugin_worker_state(TreeServerOptions("hybrid", 12, 5, 4, 6, auto=True),
                                                      auto=planner))
        self.speculative_num_steps, self.speculative_num_draft_tokens = 5, 13
        self.draft_worker = SimpleNamespace(speculative_num_steps=5, speculative_num_draft_tokens=13,
                                            draft_runner=SimpleNamespace(), _rebuild_topk1_chain_buffers=lambda: None)
        self.target_worker = SimpleNamespace(forward_batch_generation=lambda **kwargs: None,
                                             model_runner=SimpleNamespace(attn_backend=13))

        def runtime_state(size: int) -> SimpleNamespace:  # SGLang's SpecRuntimeState of one verify size
            return SimpleNamespace(speculative_num_steps=level_steps(5, size), speculative_num_draft_tokens=size,
                                   draft_attn_backend=size, cuda_graph_runner=None, target_attn_backend=size,
                                   target_graph_runner=None, draft_extend_attn_backend=None,
                                   cuda_graph_runner_for_draft_extend=None)

        self.state.shapes = VerifyShapes(self, 13, 5, {size: runtime_state(size) for size in (1, 6, 13)}, graphs=False)
        self.seen: list[tuple[int, int, int | None]] = []

    def step(self, worker, batch):
        self.seen.append((worker.speculative_num_steps, worker.speculative_num_draft_tokens, self.state.step_budget))
        # the size's attention backend is the target's and the draft's for the step
        assert worker.target_worker.model_runner.attn_backend == worker.speculative_num_draft_tokens
        return SimpleNamespace(accept_lens=torch.tensor([1, 1]))


class StubPlanner:
    """A planner that picks ``size`` and raises where told (``broken``: table, choose or observe)."""

    def __init__(self, size: int, broken: str | None = None) -> None:
        from sglang_spec.sglang_plugin.step_planner import StepPlanner

        self.inner = StepPlanner(None, (1, 6, 13), 13)
        self.size, self.broken = size, broken
        self.sizes = self.inner.sizes

    def table(self, rids):
        if self.broken == "table":
            raise KeyError("bucket")
        return self.inner.table(rids)

    def choose(self, table, batch_size):
        from sglang_spec.planner import StepPlan

        if self.broken == "choose":
            raise KeyError("bucket")
        return StepPlan(self.size, 2.0 * batch_size, 0.1, (self.size - 1,) * batch_size)

    def observe(self, *args, **kwargs):
        if self.broken == "observe":
            raise KeyError("bucket")

    def learn_reach(self, drafted):
        pass

    def __getattr__(self, name):  # the rest as the real planner has it
        return getattr(self.inner, name)


def decode_batch():
    return SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False),
                           is_extend_in_batch=False, reqs=[SimpleNamespace(rid="a"), SimpleNamespace(rid="b")])


@pytest.mark.parametrize("size, seen", [(1, (0, 1, None)), (6, (5, 6, 5)), (13, (5, 13, None))])
def test_the_planned_size_is_the_steps_and_only_its(metrics, size, seen):
    """A plain step runs SGLang's 0-step path; a smaller tree sets SGLang's verify tokens and the drafter's budget for
    the step; the full tree runs as configured; everything is restored after."""
    worker = AutoWorker(StubPlanner(size))
    auto_hooks.forward_batch_generation_around(worker.step, worker, decode_batch())
    assert worker.seen == [seen]
    assert (worker.speculative_num_steps, worker.speculative_num_draft_tokens, worker.state.step_budget) == (5, 13,
                                                                                                          None)
    assert worker.target_worker.model_runner.attn_backend == 13  # the full tree's state again
    assert not metrics.accept_faults


@pytest.mark.parametrize("broken", ["table", "choose", "observe"])
def test_a_tree_auto_fault_decodes_the_batch(metrics, capsys, broken):
    """The plan's table raises: the step is planned without this rank's inputs (a plain step here); choosing raises:
    SGLang's own plain step (0 draft steps); observe raises: the step's output stands and the planner learns
    nothing from it. The plain step a failed choice gives counts as a planned step, as any other (the stub's own
    choice counts none)."""
    planner = StubPlanner(13, broken)
    worker = AutoWorker(planner)
    output = auto_hooks.forward_batch_generation_around(worker.step, worker, decode_batch())
    assert output.accept_lens.tolist() == [1, 1]
    steps = worker.seen[0][0]
    assert steps == (0 if broken == "choose" else 5) and worker.speculative_num_steps == 5
    assert planner.inner.chosen == ({1: 1} if broken == "choose" else {})
    assert metrics.accept_faults == {(AUTO, "KeyError"): 1}
    lines = fault_lines(capsys)
    expected = {"table": "without this rank's inputs", "choose": "plain step", "observe": "did not learn"}[broken]
    assert len(lines) == 1 and expected in lines[0]


def test_a_prefill_goes_through_untouched(metrics):
    worker = AutoWorker(StubPlanner(6))
    prefill = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True, is_idle=lambda: False),
                              is_extend_in_batch=False, reqs=[SimpleNamespace(rid="a"), SimpleNamespace(rid="b")])
    auto_hooks.forward_batch_generation_around(worker.step, worker, prefill)
    assert worker.seen == [(5, 13, None)] and not metrics.accept_faults
