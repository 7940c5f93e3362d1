"""``sglang-spec adapt``'s parts without a server: the guard's verdict, the per-head counters, the traffic log's tail
(whole lines, rotation, text prompts), the rolling capture window, the checks a candidate head passes before it is
swapped in, and the kept draft vocabulary of a training round. The loop through SGLang's real server is
``tests/sglang_server/test_adapt_server.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sglang_spec.errors import SpecError
from sglang_spec.models.loading import shipped_head_path
from sglang_spec.train.adapt import (AdaptJob, AdaptSettings, Adapter, HeadStats, RollingCapture, ServedHead,
                                    held_out_accept_length, probation_verdict, screen_verdict)
from sglang_spec.train.capture import CaptureManifest, CapturedSequence, read_manifest
from sglang_spec.train.live_traffic import TailPosition, TrafficTail
from sglang_spec.train.server_counts import parse_head_counts


def generic_head() -> Path:
    return shipped_head_path("smollm2").with_name("smollm2-135m-instruct-generic.safetensors")


# ------------------------------------------------------------------------------------------------------ the guard
def test_the_verdict_waits_for_probation_then_rolls_back_a_head_that_accepts_less():
    previous = HeadStats("0", 400, 200)  # accept length 1.5
    assert probation_verdict(previous, HeadStats("1", 99, 0), 100, 0.05) is None  # still on probation
    assert probation_verdict(previous, HeadStats("1", 100, 20), 100, 0.05) == "rollback"  # 1.2
    assert probation_verdict(previous, HeadStats("1", 100, 46), 100, 0.05) == "keep"  # 1.46 >= 0.95 * 1.5
    assert probation_verdict(previous, HeadStats("1", 100, 42), 100, 0.05) == "rollback"  # 1.42 < 1.425
    assert probation_verdict(previous, HeadStats("1", 100, 80), 100, 0.0) == "keep"


def test_the_screen_scores_both_heads_as_a_chain_on_the_same_held_out_answers():
    assert held_out_accept_length([0.5, 0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert held_out_accept_length([]) == 1.0
    summary = {"eval_sequences": 3, "init_eval_top1": [0.5, 0.4], "eval_top1": [0.6, 0.5]}
    assert screen_verdict(summary) == pytest.approx((1 + 0.5 + 0.2, 1 + 0.6 + 0.3))
    assert screen_verdict({**summary, "eval_sequences": 0}) is None  # nothing held out: no screen
    assert screen_verdict({**summary, "init_eval_top1": []}) is None


def _adapter(tmp_path: Path) -> Adapter:
    served = ServedHead.of(generic_head())
    job = AdaptJob("http://127.0.0.1:9", tmp_path / "traffic.jsonl", "smollm2", served.model_type,
                   served.hidden_size, served.vocab_size, str.split, generic_head(), tmp_path / "adapt",
                   AdaptSettings(window=8, train_every=4))
    return Adapter(job, say=lambda line: None)


def _finished_round(adapter: Adapter, tmp_path: Path, summary: dict) -> None:
    """The state the loop is in when a round's trainer has exited 0 having printed ``summary``."""
    import subprocess
    import sys

    adapter.trainer = subprocess.Popen([sys.executable, "-c", ""])
    adapter.trainer.wait()
    adapter.candidate = tmp_path / "candidate.safetensors"
    adapter.trainer_log = tmp_path / "train.log"
    adapter.trainer_log.write_text("a warning\n" + json.dumps(summary) + "\n")


def test_a_candidate_that_scores_below_its_init_on_held_out_answers_is_not_swapped_in(tmp_path):
    adapter = _adapter(tmp_path)
    worse = {"eval_sequences": 4, "init_eval_top1": [0.6, 0.5], "eval_top1": [0.55, 0.5]}
    _finished_round(adapter, tmp_path, worse)
    assert adapter._training()
    assert adapter.ready is None  # not offered: the served head stays
    events = [json.loads(line) for line in (tmp_path / "adapt" / "events.jsonl").read_text().splitlines()]
    assert [event["event"] for event in events] == ["screened"]
    assert "not swapped in" in events[0]["message"] and "on the same 4 requests" in events[0]["message"]
    for summary in ({**worse, "eval_top1": [0.65, 0.5]}, {**worse, "eval_sequences": 0}):  # better; nothing held out
        _finished_round(adapter, tmp_path, summary)
        assert adapter._training()
        assert adapter.ready is not None and adapter.ready[0] == tmp_path / "candidate.safetensors"
        adapter.ready = None


def test_settings_refuse_what_cannot_work():
    with pytest.raises(SpecError, match="margin"):
        AdaptSettings(margin=1.0)
    with pytest.raises(SpecError, match="holdout"):
        AdaptSettings(holdout=1.0)
    with pytest.raises(SpecError, match="train-every"):
        AdaptSettings(window=8, train_every=16)


def test_per_head_counters_are_read_and_summed_over_processes():
    text = "\n".join([
        "# TYPE sglang_spec_head_verify_steps_total counter",
        'sglang_spec_head_verify_steps_total{head="0"} 120.0',
        'sglang_spec_head_verify_steps_total{head="0"} 30.0',
        'sglang_spec_head_accepted_drafts_total{head="0"} 75.0',
        'sglang_spec_head_verify_steps_total{head="3"} 10.0',
        'sglang_spec_head_accepted_drafts_total{head="3"} 9.0',
        'sglang_spec_head_version 2.0',
    ])
    assert parse_head_counts(text) == {"0": (150, 75), "3": (10, 9)}


# ------------------------------------------------------------------------------------------------ the traffic tail
def _line(rid: str, **fields) -> str:
    return json.dumps({"rid": rid, "input_ids": [1, 2, 3], "text": None, "output_ids": [4, 5], "prompt_tokens": 3,
                       "head": "0", **fields}) + "\n"


def test_the_tail_reads_whole_lines_once_and_follows_a_rotation(tmp_path):
    log = tmp_path / "traffic.jsonl"
    tail = TrafficTail(log, encode=lambda text: [7] * len(text.split()))
    assert tail.read() == []  # nothing served yet
    log.write_text(_line("a") + _line("HEALTH_CHECK_x") + "not json\n" + _line("b")[:20])
    assert [request.rid for request in tail.read()] == ["a"]
    assert tail.skipped == 2
    with open(log, "a") as handle:  # the half-written line completes
        handle.write(_line("b")[20:] + _line("c", input_ids=None, text="two words", prompt_tokens=2))
    requests = tail.read()
    assert [(r.rid, r.prompt, r.output) for r in requests] == [("b", (1, 2, 3), (4, 5)), ("c", (7, 7), (4, 5))]
    with open(log, "a") as handle:
        handle.write(_line("d") + _line("e", input_ids=None, text="three words here", prompt_tokens=2))
    os.replace(log, tmp_path / "traffic.jsonl.1")  # the server rotates
    log.write_text(_line("f"))
    # d before f; e's text does not give the ids the server counted: skipped
    assert [request.rid for request in tail.read()] == ["d", "f"]
    resumed = TrafficTail(log, encode=str.split, position=tail.position)
    with open(log, "a") as handle:
        handle.write(_line("g"))
    assert [request.rid for request in resumed.read()] == ["g"]
    assert TrafficTail(log, encode=str.split, position=TailPosition()).read(limit=1)[0].rid == "f"


# ---------------------------------------------------------------------------------------------- rolling capture
def _sequence(index: int, hidden_size: int = 8) -> CapturedSequence:
    return CapturedSequence(f"r{index}", "served", torch.arange(6) + index, 2, torch.randn(5, hidden_size))


def test_the_rolling_window_keeps_the_newest_sequences_and_deletes_older_shards(tmp_path):
    manifest = CaptureManifest("toy", "llama", 8, 64, "float16")
    capture = RollingCapture(tmp_path / "capture", manifest, window=6, shard_size=2)
    for start in range(0, 12, 2):
        capture.add([_sequence(start), _sequence(start + 1)])
    kept = read_manifest(tmp_path / "capture")
    assert kept.num_sequences == 6
    assert [entry.file for entry in kept.shards] == ["shard-00003.safetensors", "shard-00004.safetensors",
                                                     "shard-00005.safetensors"]
    assert sorted(path.name for path in (tmp_path / "capture").glob("shard-*")) == [e.file for e in kept.shards]
    assert capture.snapshot(tmp_path / "window") == 6
    capture.add([_sequence(12), _sequence(13)])  # capture goes on; the snapshot a round trains on does not change
    assert read_manifest(tmp_path / "window").num_sequences == 6
    assert (tmp_path / "window" / "shard-00003.safetensors").exists()
    assert not (tmp_path / "capture" / "shard-00003.safetensors").exists()


# -------------------------------------------------------------------------------------------- candidate checks
def _head_variant(path: Path, change) -> Path:
    source = generic_head()
    with safe_open(str(source), "pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(source))
    metadata = change(tensors, metadata) or metadata
    save_file(tensors, str(path), metadata=metadata)
    return path


def test_a_candidate_must_be_a_head_for_the_served_model_and_token_map(tmp_path):
    served = ServedHead.of(generic_head())
    tensors = served.draft_tensors(generic_head())
    assert "model.eh_proj.weight" in tensors and "model.decoder.self_attn.q_proj.weight" in tensors
    assert not any("embed" in name or "lm_head" in name for name in tensors)  # the shared ones stay the target's

    def other_vocabulary(tensors, metadata):
        tensors["draft_vocab"] = tensors["draft_vocab"].flip(0)

    def other_model(tensors, metadata):
        header = json.loads(metadata["sglang_spec_mtp"])
        return {**metadata, "sglang_spec_mtp": json.dumps({**header, "hidden_size": 64})}

    def not_finite(tensors, metadata):
        tensors["eh_proj.weight"][0, 0] = float("nan")

    for change, message in ((other_vocabulary, "token map"), (other_model, "another model"),
                            (not_finite, "NaN")):
        with pytest.raises(SpecError, match=message):
            served.draft_tensors(_head_variant(tmp_path / f"{change.__name__}.safetensors", change))
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(generic_head().read_bytes()[:1000])
    with pytest.raises(SpecError) as error:
        served.draft_tensors(damaged)
    assert "\n" not in str(error.value)


def test_a_served_request_longer_than_the_window_keeps_its_answer(monkeypatch):
    """capture_served prefills the whole request (the states see the whole prompt) and keeps its last
    ``max_tokens`` tokens: a long prompt leaves the answer in the window, with the states of those positions."""
    from sglang_spec.train import live_traffic

    request = live_traffic.ServedRequest("r", tuple(range(100, 130)), tuple(range(200, 210)), "0")
    sent = []

    def fake_post(url, path, payload, timeout):
        sent.append(payload["input_ids"])
        # the server's state after token i: [i, i] (hidden size 2), one row per token it computed
        return [{"meta_info": {"hidden_states": [[[float(i), float(i)] for i in range(len(ids))]]}}
                for ids in payload["input_ids"]]

    monkeypatch.setattr(live_traffic, "post_json", fake_post)
    [sequence] = live_traffic.capture_served("http://x", [request], "served", 16, 2)
    assert sent == [[list(range(100, 130)) + list(range(200, 210))]]  # the whole request, in one batch
    assert sequence.tokens.tolist() == list(range(124, 130)) + list(range(200, 210))
    assert sequence.completion_start == 6
    assert sequence.hidden[:, 0].tolist() == [float(i) for i in range(24, 39)]


@pytest.mark.parametrize("bf16", [False, True])
def test_a_round_trains_with_bf16_autocast_only_when_asked(tmp_path, monkeypatch, bf16):
    from dataclasses import replace

    import sglang_spec.train.adapt as adapt

    adapter = _adapter(tmp_path)
    adapter.settings = replace(adapter.settings, bf16=bf16)
    started = []

    class Trainer:
        def __init__(self, command, **options):
            started.append(command)

    monkeypatch.setattr(adapt.subprocess, "Popen", Trainer)
    adapter._start_training()
    assert len(started) == 1 and "train" in started[0]
    assert ("--bf16" in started[0]) == bf16
    store = started[0][started[0].index("--teacher-store") + 1]  # the rounds share one store in the work folder
    assert store == str(tmp_path / "adapt" / adapt.TEACHER_STORE)


def test_a_finished_round_drops_the_teacher_entries_it_did_not_touch(tmp_path):
    import os
    import time

    import sglang_spec.train.adapt as adapt
    from sglang_spec.train.teacher_store import SUFFIX

    adapter = _adapter(tmp_path)
    store = tmp_path / "adapt" / adapt.TEACHER_STORE
    store.mkdir(parents=True)
    left, read = store / f"left{SUFFIX}", store / f"read{SUFFIX}"
    for path in (left, read):
        path.write_bytes(b"")
        os.utime(path, (time.time() - 600,) * 2)
    adapter.round_started = time.time() - 60
    os.utime(read)  # the round read it
    _finished_round(adapter, tmp_path, {"eval_sequences": 0})
    assert adapter._training()
    assert not left.exists() and read.exists()
