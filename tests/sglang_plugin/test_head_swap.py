"""A head swapped in place (``WorkerState.swap_head``, ``hooks.adapt``): the one event, what the context drafters
forget, the metrics per head, and the traffic log's lines. Through SGLang's real server:
``tests/sglang_server/test_adapt_server.py``."""

from __future__ import annotations

import json
from types import SimpleNamespace

from doubles import plugin_worker_state
from sglang_spec.sglang_plugin.drafters.host_context import HostContextDrafter
from sglang_spec.sglang_plugin.hooks import adapt
from sglang_spec.sglang_plugin.metrics import AcceptanceMetrics
from sglang_spec.sglang_plugin.state import HeadSwap, attach
from sglang_spec.train.server_counts import LAUNCH_HEAD
from sglang_spec.sglang_plugin.traffic_log import TrafficLog, entry
from sglang_spec.tree.policies import TreePolicy


def test_a_swap_moves_the_version_on_and_runs_the_callbacks_in_order():
    state = plugin_worker_state()
    seen: list[tuple[str, HeadSwap]] = []
    state.head_swapped += [lambda swap: seen.append(("planner", swap)), lambda swap: seen.append(("other", swap))]
    assert (state.head_version, state.head_label) == (0, LAUNCH_HEAD)
    state.swap_head("7")
    state.swap_head(None)
    assert (state.head_version, state.head_label) == (2, "2")
    assert seen == [("planner", HeadSwap(1, "7")), ("other", HeadSwap(1, "7")),
                    ("planner", HeadSwap(2, "2")), ("other", HeadSwap(2, "2"))]


def test_a_context_drafter_forgets_the_old_heads_cells_only():
    drafter = HostContextDrafter(TreePolicy("hybrid", budget=8, depth=4, topk=2), steps=4, budget=8)
    cells = drafter.drafter.counts.named_cells()
    prior = {name: list(cell) for name, cell in cells.items()}
    for cell in cells.values():  # what serving taught it
        cell[0] += 3
        cell[1] += 5
    drafter.head_swapped()
    for name, cell in drafter.drafter.counts.named_cells().items():
        if name.split("/")[0] in ("mtp", "mtp_top1", "both"):
            assert cell == prior[name], name
        else:
            assert cell == [prior[name][0] + 3, prior[name][1] + 5], name


def test_the_swap_hook_tells_the_worker_and_counts_per_head(monkeypatch):
    metrics = AcceptanceMetrics()
    monkeypatch.setattr(adapt, "METRICS", metrics)
    state = plugin_worker_state()
    worker = SimpleNamespace()
    attach(worker, state)
    manager = SimpleNamespace(draft_worker=worker)
    metrics.record(2)
    adapt.update_from_tensor_after(SimpleNamespace(success=False), manager,
                                   SimpleNamespace(selector="draft", weight_version="1"))
    adapt.update_from_tensor_after(SimpleNamespace(success=True), manager,
                                   SimpleNamespace(selector="target", weight_version="1"))
    assert state.head_version == 0  # a failed update, or one that did not reach the draft, is no swap
    adapt.update_from_tensor_after(SimpleNamespace(success=True), manager,
                                   SimpleNamespace(selector="draft", weight_version="1"))
    metrics.record(0)
    metrics.record(3)
    adapt.update_from_disk_after(SimpleNamespace(success=True), manager, SimpleNamespace(weight_version="0"))
    metrics.record(1)
    assert state.head_version == 2 and state.head_label == "0"
    assert metrics.by_head == {"0": [2, 3], "1": [2, 3]}
    assert metrics.head_accept_length("1") == 2.5 and metrics.head_accept_length("9") is None


def _request(**fields):
    return SimpleNamespace(**{"rid": "r1", "input_ids": None, "text": "hello", "return_hidden_states": False,
                              **fields})


def _answer(**meta):
    return {"output_ids": [5, 6, 7], "meta_info": {"completion_tokens": 3, "prompt_tokens": 2,
                                                   "finish_reason": {"type": "length"}, **meta}}


def test_the_traffic_log_keeps_served_requests_only(tmp_path):
    assert entry(_request(input_ids=[1, 2]), _answer(), "0") == {
        "rid": "r1", "input_ids": [1, 2], "text": None, "output_ids": [5, 6, 7], "prompt_tokens": 2, "head": "0"}
    assert entry(_request(), _answer(), "3")["text"] == "hello"
    assert entry(_request(return_hidden_states=True), _answer(), "0") is None  # adapt's own captures
    assert entry(_request(), _answer(finish_reason={"type": "abort"}), "0") is None
    assert entry(_request(), _answer(completion_tokens=9), "0") is None  # a streamed chunk, not the whole answer
    log = TrafficLog(tmp_path / "traffic.jsonl", max_bytes=300)
    for index in range(5):
        assert log.write({"rid": str(index), "pad": "x" * 80})
    kept = [json.loads(line)["rid"] for name in ("traffic.jsonl.1", "traffic.jsonl")
            for line in (tmp_path / name).read_text().splitlines()]
    assert kept == ["0", "1", "2", "3", "4"][-len(kept):] and len(kept) >= 3  # rotated, bounded, in order


def test_a_traffic_log_that_cannot_be_written_is_counted_and_serving_goes_on(tmp_path, capsys):
    log = TrafficLog(tmp_path / "missing-folder" / "traffic.jsonl")
    assert not log.write({"rid": "1"}) and not log.write({"rid": "2"})
    assert log.failed == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "traffic log" in line]
    assert len(lines) == 1 and "goes on serving" in lines[0]


def test_the_planner_forgets_the_old_heads_acceptance_and_keeps_its_costs():
    from collections import deque

    from sglang_spec.sglang_plugin.step_planner import StepPlanner, UnrankedRequest

    planner = StepPlanner(None, (1, 4, 7), 7, prior=[0.9, 0.5])
    planner.learn_reach({"a": (0.95, 0.8, 0.7)})
    planner.accepted_seen[1], planner.accepted_of["b"] = deque([(2.6, 2.0)]), UnrankedRequest(2.0, 0, 1)
    planner.served[(1, 4)] = 0.01
    learnt = planner.predicted_reach("a")
    state = plugin_worker_state()
    state.head_swapped.append(lambda swap: planner.head_swapped([0.6, 0.2]))
    state.swap_head("new")
    assert planner.predicted_reach("a") == [0.6, 0.2] != learnt  # the new head's prior, nothing of the old head's
    assert (planner.accept_scale(1), planner.accepted_seen, planner.accepted_of) == (1.0, {}, {})
    assert planner.served == {(1, 4): 0.01}
