"""The CPU bed's decode-graph stand-in (``sglang_spec_testbed/graphs.py``): a replay answers as a replayed CUDA graph
does (the captured forward on the static buffers, its result in the captured output tensors, which a caller that
kept them sees overwritten by the next replay), a host read inside the captured run stops the capture, and the
switch takes 0 or 1 only. Servers that replay it through SGLang's ``DecodeCudaGraphRunner`` are in
``tests/sglang_server/test_planner_matrix.py`` (the ``on`` cells) and ``test_parity_under_load.py`` (``-graphs``)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from sglang_spec.errors import SpecError
from sglang_spec_testbed import graphs


@dataclass(frozen=True)
class ShapeKey:
    """SGLang's graph key's one field a replay's log line reads."""

    size: int


def captured(static_input: torch.Tensor):
    """A stand-in backend with one shape captured whose forward doubles the static input (a tensor and a field of an
    output object, as SGLang's LogitsProcessorOutput holds them)."""
    backend = graphs.StandInGraphBackend(SimpleNamespace(captured_req_width=3, raw_bs=2, ragged_verify_mode=False))
    calls = []

    def forward():
        calls.append(graphs.StandInGraphBackend.capturing)
        return SimpleNamespace(next_token_logits=static_input * 2, hidden_states=None), [static_input + 1]

    key = ShapeKey(size=4)
    backend.capture_one(key, forward)
    return backend, key, calls


def test_a_replay_reads_the_static_inputs_into_the_captured_outputs():
    static_input = torch.arange(4.0)
    backend, key, calls = captured(static_input)
    assert calls == [False, False, True]  # SGLang's two warm-ups, then the run it captures
    first = backend.replay(key, None)
    held = first[0].next_token_logits
    assert torch.equal(held, torch.arange(4.0) * 2) and torch.equal(first[1][0], torch.arange(4.0) + 1)
    static_input.copy_(torch.tensor([5.0, 6.0, 7.0, 8.0]))  # load_batch's copy of the next batch
    second = backend.replay(key, None)
    assert second[0].next_token_logits is held  # the graph's static output, overwritten in place
    assert torch.equal(held, torch.tensor([10.0, 12.0, 14.0, 16.0]))
    assert backend.can_run(None, key) and not backend.can_run(None, ShapeKey(size=8))


def test_the_replay_line_reads_back_as_batch_and_graph_size():
    lines = [graphs.REPLAY_LOG.format(width=width, batch=batch, size=size)
             for width, batch, size in ((16, 6, 8), (1, 3, 4))]
    log_text = "\n".join(["[sglang_spec] " + line for line in lines] + ["unrelated"])
    assert graphs.replays_in(log_text) == [(6, 8), (3, 4)]


def test_the_ragged_replay_line_reads_back_as_batch_tier_and_slots():
    line = graphs.RAGGED_REPLAY_LOG.format(batch=3, tier=16, slots=4)
    log_text = "\n".join(["[sglang_spec] " + line, "[sglang_spec] " + graphs.REPLAY_LOG.format(width=1, batch=3,
                                                                                               size=4)])
    assert graphs.ragged_replays_in(log_text) == [(3, 16, 4)] and graphs.replays_in(log_text) == [(3, 4)]


def test_a_host_read_inside_a_capture_stops_it_as_a_cuda_capture_would():
    """``.item()`` in the captured run (here, this test's code: neither torch nor a device kernel's stand-in)
    raises, naming the line; the warm-up runs before it read freely."""
    static_input = torch.arange(4.0)
    backend = graphs.StandInGraphBackend(SimpleNamespace(captured_req_width=1, raw_bs=1, ragged_verify_mode=False))
    reads = []

    def forward():
        reads.append(float(static_input.sum().item()))
        return static_input * 2

    with pytest.raises(RuntimeError, match=r"host read inside a captured decode graph, at .*test_cpu_graphs.py:\d+"):
        backend.capture_one(ShapeKey(size=1), forward)
    assert reads == [6.0, 6.0] and not graphs.StandInGraphBackend.capturing


def test_the_switch_takes_zero_or_one(monkeypatch):
    monkeypatch.setenv(graphs.GRAPHS_ENV, "1")
    assert graphs.graphs_from_environment()
    monkeypatch.setenv(graphs.GRAPHS_ENV, "0")
    assert not graphs.graphs_from_environment()
    monkeypatch.setenv(graphs.GRAPHS_ENV, "yes")
    with pytest.raises(SpecError, match="use 1"):
        graphs.graphs_from_environment()
