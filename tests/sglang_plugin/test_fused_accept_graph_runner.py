"""The fused greedy accept under SGLang's verify CUDA graphs, driven by SGLang's own ``DecodeCudaGraphRunner``
bookkeeping: its capture loop (``_capture_one_stream`` / ``capture_one_shape``), ``load_batch`` (DP padding, graph
key) and ``execute``, with only the graph itself stood in (``StandInGraphs`` records the device work done during
capture and replays exactly that, on the same tensors, as a CUDA graph would).

* the accept read after a replay is the replayed graph's, when SGLang pads the batch to the largest across DP ranks
  and when the graph key holds more than the batch size (LoRA variants);
* nothing from a replay survives its verify step: a later eager verify at the same size computes its own accept.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import random_tree, targets_following_drafts
from doubles import plugin_worker_state
from sglang_spec.sglang_plugin import fused_accept
from sglang_spec.sglang_plugin.hooks import accept as hooks
from sglang_spec.sglang_plugin.state import attach
from sglang_spec.sglang_plugin.fused_accept import AcceptBuffers, FusedAccept, run_accept
from sglang_spec.tree import encode_sglang_verify

pytestmark = pytest.mark.sglang

VOCAB, NODES, DEPTH = 30, 7, 3
CAPTURE_BS = [1, 2, 4, 8]


class StandInGraphs:
    """The runner's graph backend: ``capture_one`` runs the forward once as warm-up and once recording the device
    work (the stand-in model's logits and ``run_accept``), ``replay`` repeats that recorded work only."""

    def __init__(self) -> None:
        self.tapes: dict = {}
        self.outputs: dict = {}
        self._tape: list | None = None

    def record(self, work, *args) -> None:
        if self._tape is not None:
            self._tape.append((work, args))
        work(*args)

    def capture_one(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None) -> None:
        forward_fn()
        self._tape = []
        self.outputs[shape_key] = forward_fn()
        self.tapes[shape_key], self._tape = self._tape, None

    def replay_session(self):
        return contextlib.nullcontext()

    def replay(self, shape_key, forward_batch):
        for work, args in self.tapes[shape_key]:
            work(*args)
        return self.outputs[shape_key]


class StandInRegistry:
    """``load_batch``'s input copy: the batch's tokens, and the logits the model would compute from them, into
    the static inputs (padded rows keep whatever an earlier replay left, as in SGLang)."""

    def __init__(self, buffers) -> None:
        self.buffers = buffers

    def fill_from(self, forward_batch, *, raw_num_tokens, **_) -> None:
        self.buffers.input_ids[:raw_num_tokens].copy_(forward_batch.input_ids)
        self.buffers.model_logits[:raw_num_tokens].copy_(forward_batch.model_logits)


def make_runner(monkeypatch, *, dp_gather: bool, lora_variants: bool):
    """SGLang's DecodeCudaGraphRunner (its methods, unchanged) over stand-in state, captured at CAPTURE_BS."""
    from sglang.srt.layers.attention.base_attn_backend import SharedReadEnds
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.model_executor.runner import decode_cuda_graph_runner as module

    monkeypatch.setattr(module, "get_exec", lambda: SimpleNamespace(graph=SimpleNamespace(debug_cuda_graph=False)))
    monkeypatch.setattr(module, "get_parallel", lambda: SimpleNamespace(tp_rank=1, tp_group=None))
    monkeypatch.setattr(module, "get_available_gpu_memory", lambda *args, **kwargs: 0.0)

    graphs = StandInGraphs()
    max_tokens = max(CAPTURE_BS) * NODES
    buffers = SimpleNamespace(input_ids=torch.zeros(max_tokens, dtype=torch.int64),
                              positions=torch.zeros(max_tokens, dtype=torch.int64),
                              model_logits=torch.zeros(max_tokens, VOCAB), num_token_non_padded=None)

    def model_forward(input_ids, positions, forward_batch):
        logits = torch.empty(input_ids.shape[0], VOCAB)
        graphs.record(torch.Tensor.copy_, logits, buffers.model_logits[: input_ids.shape[0]])
        return LogitsProcessorOutput(next_token_logits=logits)

    def capture_prepare(bs, stream_idx=None, num_tokens=None):
        forward_batch = SimpleNamespace(
            batch_size=bs, input_ids=buffers.input_ids[:num_tokens], positions=buffers.positions[:num_tokens],
            forward_mode=ForwardMode.TARGET_VERIFY, lora_ids=None, global_dp_buffer_len=None,
            global_num_tokens_cpu=None, moe_num_token_non_padded=None,
            dp_padding_mode=SimpleNamespace(is_max_len=lambda: False))
        attention = SimpleNamespace(init_forward_metadata_out_graph=lambda *args, **kwargs: None,
                                    init_forward_metadata_in_graph=lambda *args: None)
        return forward_batch, attention, None

    def nothing(*args, **kwargs) -> None:
        return None

    runner = object.__new__(module.DecodeCudaGraphRunner)
    runner.model_runner = SimpleNamespace(
        is_draft_worker=False, capture_head_hooks=[], capture_tail_hooks=[], canary_manager=None,
        model=SimpleNamespace(forward=model_forward), hisparse_coordinator=None, device="cpu", gpu_id=0,
        device_timer=None, lora_manager=None,
        spec_algorithm=SimpleNamespace(is_dflash_family=lambda: False, is_speculative=lambda: True))
    runner.__dict__.update(
        # what SGLang's graph keys and padding read
        capture_bs=CAPTURE_BS, compile_bs=[], max_bs=max(CAPTURE_BS), captured_req_width=NODES,
        record_nolora_graph=lora_variants, attention_graph_variants=None, enable_pdmux=False,
        ragged_verify_mode=False, require_mlp_tp_gather=dp_gather, disable_padding=False,
        capture_hidden_mode=CaptureHiddenMode.FULL, capture_forward_mode=ForwardMode.TARGET_VERIFY,
        # the graph, the static inputs and the capture-time batch, stood in
        backend=graphs, buffers=buffers, buffer_registry=StandInRegistry(buffers), capture_prepare=capture_prepare,
        # features this runner does not use
        is_dllm=False, dllm_uses_input_embeds=False, dllm_input_preparation=None, pp_size=1,
        enable_two_batch_overlap=False, in_graph_metadata_prep_done=None, _early_verify_metadata=None,
        _metadata_glue=None, _draft_metadata_glue=False, _target_metadata_glue=False, _skips_prefilled_inputs=False,
        _profiler=None, _metadata_prep_fork_resolved=True,
        tbo_plugin=SimpleNamespace(capture_one_batch_size=nothing),
        deepep_adapter=SimpleNamespace(capture=nothing, replay=nothing),
        device_module=SimpleNamespace(is_current_stream_capturing=lambda: False),
        attn_backend=SimpleNamespace(shared_read_ends=lambda mode: SharedReadEnds.POST_REPLAY),
        # the device work around a replay that is not the fused accept's
        model_context=contextlib.nullcontext, _publish_read_done=nothing, _init_replay_attn_metadata=nothing)
    return runner


def capture(runner, monkeypatch) -> FusedAccept:
    """The fused accept hooked in as the worker does (before capture), then SGLang's capture loop, recording
    ``run_accept`` calls as graph work."""
    fused = FusedAccept(NODES, DEPTH, "cpu", SimpleNamespace(record_accept=lambda outcome: None))
    runner.model_runner.capture_tail_hooks.append(fused.capture_tail)
    monkeypatch.setattr(fused_accept, "run_accept",
                        lambda *args: runner.backend.record(run_accept, *args))
    runner._capture_one_stream()
    return fused


def verify_batch(seed: int, batch: int, *, dp_counts=None, lora: bool = False, logit_bias: bool = False):
    """One verify step's inputs: SGLang's verify input (links, candidates), schedule batch and forward batch, and
    the logits the target model gives them ([bs * n, V], argmax following the drafts most of the time)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, NODES, 3, DEPTH, vocab_size=VOCAB) for _ in range(batch)]
    meta = encode_sglang_verify(trees, [DEPTH + 1] * batch)
    target = targets_following_drafts(rng, trees, NODES, accept_rate=0.85, vocab_size=VOCAB)
    logits = torch.nn.functional.one_hot(target.reshape(-1), VOCAB).float() * 5 \
        + torch.from_numpy(rng.random((batch * NODES, VOCAB))).float()
    verify_input = SimpleNamespace(retrieve_next_token=meta.retrieve_next_token.long(),
                                   retrieve_next_sibling=meta.retrieve_next_sibling.long(),
                                   draft_token=meta.draft_tokens.long(), draft_token_num=NODES)
    sampling_info = SimpleNamespace(
        acc_additive_penalties=None, acc_scaling_penalties=None, logit_bias=torch.zeros(1) if logit_bias else None,
        has_watermark_candidates=False, is_all_greedy=True)
    schedule_batch = SimpleNamespace(seq_lens=torch.full((batch,), 9), sampling_info=sampling_info,
                                     forward_mode=ForwardMode.TARGET_VERIFY, device="cpu", reqs=[None] * batch,
                                     req_pool_indices=torch.arange(batch))
    forward_batch = SimpleNamespace(
        batch_size=batch, forward_mode=ForwardMode.TARGET_VERIFY, spec_info=verify_input,
        input_ids=meta.draft_tokens.long(), positions=torch.zeros(batch * NODES, dtype=torch.int64),
        model_logits=logits, original_global_num_tokens_cpu=dp_counts, lora_ids=["adapter"] * batch if lora else None,
        capture_hidden_mode=CaptureHiddenMode.FULL, needs_forward_metadata_init=lambda: True)
    return SimpleNamespace(verify_input=verify_input, schedule_batch=schedule_batch, forward_batch=forward_batch,
                           logits=logits)


def verify(runner, fused: FusedAccept, step, *, graph: bool):
    """What EAGLEWorkerV2.verify does around the accept, through the plugin's hooks: the target forward (graph
    replay or eager), then eagle_sample. Returns (predict, accept_lens, accept_index)."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    def sglang_eagle_sample(*args, **kwargs):
        return "sglang's accept"

    def worker_verify(worker):
        if graph:
            output = hooks.graph_execute_around(DecodeCudaGraphRunner.execute, runner, step.forward_batch)
            output.next_token_logits.zero_()  # so that only the accept computed inside the graph can be right
        else:
            output = LogitsProcessorOutput(next_token_logits=step.logits.clone())
        return hooks.eagle_sample_around(sglang_eagle_sample, step.verify_input, step.schedule_batch, output)

    worker = SimpleNamespace()
    attach(worker, plugin_worker_state(fused=fused))
    return hooks.verify_around(worker_verify, worker)


def expected(step) -> tuple[torch.Tensor, ...]:
    """The fused accept run eagerly on fresh buffers (itself checked against SGLang's in test_fused_accept.py)."""
    batch = step.forward_batch.batch_size
    buffers = AcceptBuffers.allocate(batch, NODES, DEPTH, "cpu")
    buffers.first_child.copy_(step.verify_input.retrieve_next_token)
    buffers.next_sibling.copy_(step.verify_input.retrieve_next_sibling)
    run_accept(buffers, step.verify_input.draft_token.view(batch, NODES), step.logits, DEPTH)
    accepted = buffers.outputs(batch)
    return accepted.predict, accepted.accept_lens, accepted.accept_index


def assert_accept(result, step) -> None:
    assert isinstance(result, tuple), result
    for name, ours, theirs in zip(("predict", "accept_lens", "accept_index"), result, expected(step)):
        assert torch.equal(ours, theirs), name


@pytest.fixture
def spec_settings(sglang_with_plugin, monkeypatch):
    import sglang.srt.runtime_context as runtime_context

    monkeypatch.setattr(runtime_context, "get_spec", lambda: SimpleNamespace(
        speculative_use_rejection_sampling=False, speculative_accept_threshold_single=1.0,
        speculative_accept_threshold_acc=1.0))


def test_dp_padded_replay_reads_the_graph_sglang_replayed(spec_settings, monkeypatch):
    runner = make_runner(monkeypatch, dp_gather=True, lora_variants=False)
    fused = capture(runner, monkeypatch)
    # 3 requests here, 6 on another DP rank: SGLang replays the bs-8 graph, not the bs-4 one
    for seed, dp_counts in ((1, [3, 3]), (2, [3, 6]), (3, [6, 3]), (4, [3, 1])):
        step = verify_batch(seed, 3, dp_counts=dp_counts)
        assert_accept(verify(runner, fused, step, graph=True), step)
        assert runner.bs == runner._pad_to_bucket(max(dp_counts), CAPTURE_BS)


def test_graph_key_beyond_batch_size_reads_the_replayed_variant(spec_settings, monkeypatch):
    runner = make_runner(monkeypatch, dp_gather=False, lora_variants=True)
    fused = capture(runner, monkeypatch)
    for seed, lora in ((5, False), (6, True), (7, True), (8, False)):
        step = verify_batch(seed, 4, lora=lora)
        assert_accept(verify(runner, fused, step, graph=True), step)
        assert runner._replay_graph_key.variant_label == ("lora" if lora else "nolora")


def test_eager_verify_after_an_unread_replay_computes_its_own_accept(spec_settings, monkeypatch):
    runner = make_runner(monkeypatch, dp_gather=False, lora_variants=False)
    fused = capture(runner, monkeypatch)
    # a replayed batch whose accept SGLang serves (logit bias), then an eager verify of the same size
    assert verify(runner, fused, verify_batch(9, 3, logit_bias=True), graph=True) == "sglang's accept"
    step = verify_batch(10, 3)
    assert_accept(verify(runner, fused, step, graph=False), step)
    assert fused.counts == {"logit_bias": 1, "fused": 1}
