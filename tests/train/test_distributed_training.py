"""Training from a captured dataset on the distributed engine: two ``torchrun`` processes (gloo, FSDP2) and one
plain process reach the same loss and weights from the same data and seed; the soft targets made from captured
states through the output head are the teacher pass's; the target's layers are never loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from captured import toy_sequences, write_capture
from sglang_spec.cli import main
from sglang_spec.mtp.checkpoint import read_mtp_header
from sglang_spec.train import trainer
from sglang_spec.train.trainer import (TrainConfig, build_teacher_cache, captured_data, make_batch,
                                      teacher_from_capture)

TRAIN = ["train", "--steps", "6", "--batch-size", "4", "--checkpoint-every", "3", "--draft-vocab", "64",
         "--unroll", "2", "--eval-fraction", "0.25", "--lr", "0.005", "--json"]


@pytest.fixture(scope="module")
def capture(tiny, tmp_path_factory):
    return write_capture(tmp_path_factory.mktemp("capture") / "toy", toy_sequences(tiny[0], 12, length=20))


def _torchrun(processes: int, args: list[str]) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
               "-m", "sglang_spec.cli", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout  # rank 0 alone reports
    return json.loads(lines[0])


def _weights(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


@pytest.fixture(scope="module")
def one_process(capture, tmp_path_factory):
    """The 6-step run in one plain process (no torchrun): its head file."""
    out = tmp_path_factory.mktemp("one") / "one.safetensors"
    assert main([*TRAIN, "--capture", str(capture), "--out", str(out)]) == 0
    return out


def test_two_processes_reach_the_loss_and_weights_of_one(capture, one_process, tmp_path, capsys):
    capsys.readouterr()
    two, other_seed = tmp_path / "two.safetensors", tmp_path / "s1.safetensors"
    double = _torchrun(2, [*TRAIN, "--capture", str(capture), "--out", str(two)])
    assert double["world_size"] == 2 and double["steps"] == 6
    history_one = read_mtp_header(one_process)["metadata"]["history"]
    history_two = read_mtp_header(two)["metadata"]["history"]
    assert [h["step"] for h in history_two] == [3, 6]
    for a, b in zip(history_one, history_two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        # the batch's gradient, not its average over the ranks (AdamW would hide a constant factor)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["train_top1"] == pytest.approx(a["train_top1"], abs=1e-9)
        assert b["eval_top1"] == pytest.approx(a["eval_top1"], abs=1e-9)
    assert history_one[1]["loss"] < history_one[0]["loss"]  # it trained
    weights_one, weights_two = _weights(one_process), _weights(two)
    assert weights_one.keys() == weights_two.keys()
    for name in weights_one:
        # AdamW divides each update by its gradient's running magnitude, so where a gradient is near zero the two
        # ranks' summation order (a rounding difference) moves a weight by a small fraction of one step (lr 5e-3):
        # a few millionths here, against the > 1e-3 another seed's batches move them
        torch.testing.assert_close(weights_two[name], weights_one[name], atol=2e-5, rtol=1e-5, msg=name)
    # the agreement means something: another seed (other batches) ends elsewhere
    assert main([*TRAIN, "--capture", str(capture), "--out", str(other_seed), "--seed", "1"]) == 0
    capsys.readouterr()
    assert max((w - weights_one[n]).abs().max().item() for n, w in _weights(other_seed).items()) > 1e-3


def test_a_run_interrupted_in_one_process_resumes_on_two(capture, one_process, tmp_path, capsys, monkeypatch):
    out = tmp_path / "head.safetensors"
    calls = {"n": 0}
    original = trainer.unrolled_loss

    def interrupt(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:  # steps 1-3, the evaluation at step 3, then Ctrl-C in step 4
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer, "unrolled_loss", interrupt)
    assert main([*TRAIN, "--capture", str(capture), "--out", str(out)]) == 2
    assert "continue with --resume" in capsys.readouterr().err
    assert torch.load(trainer.state_path_for(out), weights_only=True)["step"] == 3
    resumed = _torchrun(2, [*TRAIN, "--capture", str(capture), "--out", str(out), "--resume"])
    assert resumed["steps"] == 6 and not trainer.state_path_for(out).exists()
    # the optimizer, schedule and batch stream continue where they stopped: the uninterrupted run's weights
    weights_one = _weights(one_process)
    for name, weight in _weights(out).items():
        torch.testing.assert_close(weight, weights_one[name], atol=1e-6, rtol=1e-5, msg=name)


def test_soft_targets_from_captured_states_are_the_teacher_pass(tiny, capture):
    loaded, _ = tiny
    from sglang_spec.train.capture import iter_captured

    config = TrainConfig(draft_vocab=64, top_k_targets=8, seq_len=64)
    data, hidden = captured_data(loaded, list(iter_captured(capture)), config)
    from_capture = teacher_from_capture(data, hidden, loaded.model.lm_head.weight, 8, progress=False)
    teacher = build_teacher_cache(loaded, data.records, data.draft_vocab, 8, progress=False)
    for row in range(len(data.records)):
        assert len(data.records[row].tokens) == 19  # 20 tokens, the last without a state
        torch.testing.assert_close(from_capture.hidden[row].float(), teacher.hidden[row].float(), atol=4e-3,
                                   rtol=1e-3)
        # the captured states are float16: the most likely next token agrees, the probabilities to ~1e-2
        assert torch.equal(from_capture.target_ids[row][:, 0], teacher.target_ids[row][:, 0])
        torch.testing.assert_close(from_capture.target_probs[row][:, 0].float(),
                                   teacher.target_probs[row][:, 0].float(), atol=1e-2, rtol=0)


@pytest.mark.parametrize("extra, message", [
    (["--model", "smollm2"], "captured from 'tiny-deepseek', not 'smollm2'"),
    (["--domain", "toy"], "--domain filters traffic; a capture is trained on as a whole"),
    (["--traffic", "t.jsonl"], "argument --traffic: not allowed with argument --capture"),
    (["--batch-size", "1", "--init", "nowhere.safetensors"], "--init nowhere.safetensors does not exist"),
])
def test_bad_capture_training_fails_in_one_line(capture, tmp_path, capsys, extra, message):
    code = main([*TRAIN, "--capture", str(capture), *extra, "--out", str(tmp_path / "h.safetensors")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "h.safetensors").exists()


def test_a_folder_that_is_no_capture_is_refused(tmp_path, capsys):
    code = main([*TRAIN, "--capture", str(tmp_path), "--out", str(tmp_path / "h.safetensors")])
    err = capsys.readouterr().err
    assert code == 2 and "is not a captured dataset (no manifest.json)" in err, err


def test_a_capture_longer_than_seq_len_keeps_its_end_the_answer(tiny):
    """A long prompt (a document to extract from) cut at ``seq_len``: the window that ends at the answer is
    trained on, with the states the server computed there, never the prompt's start alone."""
    loaded, _ = tiny
    from captured import toy_sequences

    sequence = toy_sequences(loaded, 1, length=40, prompt_length=30)[0]
    data, hidden = captured_data(loaded, [sequence], TrainConfig(draft_vocab=64, top_k_targets=8, seq_len=16))
    record = data.records[0]
    assert record.tokens == sequence.tokens[23:39].tolist()  # 39 tokens carry a state: the last 16 of them
    assert record.completion_start == 7  # the answer starts at token 30
    assert torch.equal(hidden[0], sequence.hidden[23:39])


def test_a_round_from_an_init_head_scores_that_head_first_on_the_same_held_out_answers(capture, one_process,
                                                                                       tmp_path, capsys):
    """What adapt's screen compares: the --init head's held-out top-1 before training, on the rows and positions
    the trained head is scored on after (the init head's own run ended at that figure on the same rows)."""
    capsys.readouterr()
    out = tmp_path / "next.safetensors"
    assert main([*TRAIN, "--capture", str(capture), "--init", str(one_process), "--keep-draft-vocab",
                 "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    final = read_mtp_header(one_process)["metadata"]["history"][-1]["eval_top1"]
    assert summary["eval_sequences"] > 0 and len(summary["init_eval_top1"]) == 2
    assert summary["init_eval_top1"] == pytest.approx(final, abs=1e-6)
    plain = tmp_path / "plain.safetensors"
    assert main([*TRAIN, "--capture", str(capture), "--out", str(plain)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["init_eval_top1"] == []  # no --init


def test_held_out_agreement_counts_the_answers_where_a_server_drafts(tiny, capture):
    loaded, _ = tiny
    from sglang_spec.train.capture import iter_captured

    data, hidden = captured_data(loaded, list(iter_captured(capture)), TrainConfig(draft_vocab=64, top_k_targets=8))
    cache = teacher_from_capture(data, hidden, loaded.model.lm_head.weight, 8, progress=False)
    record = data.records[0]
    assert record.first_drafted == 7  # the prompt is 6 tokens; the prefill answers token 6
    drafted = make_batch(cache, [0], torch.device("cpu"), torch.float32, drafted_only=True).loss_mask[0]
    assert not drafted[:7].any() and drafted[7 : len(record.tokens)].all()
    assert make_batch(cache, [0], torch.device("cpu"), torch.float32).loss_mask[0, : len(record.tokens)].all()
