"""``sglang-spec capture`` through SGLang's real server on this CPU: the stored tokens are the server's answers and
the stored states are the target's final hidden states (transformers computes the same ones from the stored
tokens), for the tiny DeepSeek-V3 served with speculation (NEXTN, its own MTP layer) and SmolLM2 served plainly;
a second capture resumes; a head trains from each capture without the target loaded. For both models the loop
closes: the head trained on 2 processes is exported, served and measured (``head_accept``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import islice

import pytest
import torch

from cpu_server_helpers import running_server
from sglang_spec.cli import main
from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder
from sglang_spec.mtp.checkpoint import load_mtp_head, save_mtp_head
from sglang_spec.mtp.head import MTPHead
from sglang_spec_testbed import head_accept
from sglang_spec.tree import TreePolicy
from sglang_spec.models.loading import ByteTokenizer
from sglang_spec.models.toy_language import ToyLanguage
from sglang_spec.train.capture import iter_captured, read_manifest
from sglang_spec.train.prompts import humaneval_prompts

CAPTURE_FLAGS = ["--enable-return-hidden-states", "--disable-radix-cache"]
TREE = ["--speculative-tree-policy", "chain", "--speculative-tree-budget", "3", "--speculative-tree-depth", "3"]
HELDOUT_TOKENS = 24
TRAIN = ["--steps", "2", "--batch-size", "2", "--checkpoint-every", "2", "--draft-vocab", "64", "--unroll", "2",
         "--eval-fraction", "0", "--json"]


@torch.no_grad()
def assert_states_are_the_targets(loaded, folder, tolerance):
    """Each stored state row i is the target's final hidden state after token i (relative to the largest)."""
    for sequence in iter_captured(folder):
        hidden = loaded.model.model(input_ids=sequence.tokens[None], use_cache=False).last_hidden_state[0, :-1]
        error = (sequence.hidden.float() - hidden).abs().max() / hidden.abs().max()
        assert error < tolerance, (sequence.id, float(error))


def capture_twice(url, model, prompts, out, new_tokens, capsys) -> dict:
    args = ["capture", "--from-server", url, "--model", model, "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", str(new_tokens), "--batch-size", "8", "--shard-size", "16", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["captured"] == 0 and again["skipped"] == first["captured"] == again["sequences"]
    return first


def test_tiny_deepseek_capture_train_on_two_processes_export_and_serve(tiny_cpu, server_logs, tiny, tmp_path,
                                                                         capsys):
    """The closed loop: capture from a speculating server → a fresh head trained on 2 processes (torchrun, FSDP2)
    → exported in DeepSeek's layout → served by NEXTN. Served, its accept length is within 5% of the same head's
    in the reference decoder and higher than the head it started from, on held-out prompts (``head_accept``)."""
    loaded, _ = tiny
    language = ToyLanguage(512, seed=123)  # the language tiny-deepseek was trained on
    prompts = [language.sample(1, 6)[0].tolist() for _ in range(54)]
    train_file, heldout_file = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
    for path, chosen in ((train_file, prompts[:48]), (heldout_file, prompts[48:])):
        path.write_text("".join(json.dumps({"prompt": ByteTokenizer().decode(p), "domain": "toy"}) + "\n"
                                for p in chosen))
    capture = tmp_path / "capture"
    with running_server(tiny_cpu, server_logs, "tiny-capture", [*CAPTURE_FLAGS, *TREE]) as server:
        first = capture_twice(server.url, "tiny-deepseek", train_file, capture, 32, capsys)
        stored = list(iter_captured(capture))
        answers = server.generate([s.tokens[: s.completion_start].tolist() for s in stored[:4]],
                                  {"temperature": 0, "max_new_tokens": 32})
    assert first["captured"] == 48 and first["tokens"] == 48 * (6 + 32)
    assert [s.tokens[s.completion_start :].tolist() for s in stored[:4]] == [a["output_ids"] for a in answers]
    assert_states_are_the_targets(loaded, capture, 2e-3)

    # the head it starts from: a fresh one (SGLang's NextN feeds back the post-norm state)
    torch.manual_seed(0)
    start = save_mtp_head(MTPHead.for_target(loaded.model, feedback="post_norm"), tmp_path / "start.safetensors",
                          metadata={"model": "tiny-deepseek"})
    trained = tmp_path / "trained.safetensors"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "sglang_spec.cli", "train", "--capture", str(capture), "--init", str(start), "--out", str(trained),
               "--feedback", "post_norm", "--draft-vocab", "0", "--steps", "40", "--batch-size", "8",
               "--checkpoint-every", "40", "--unroll", "3", "--lr", "0.005", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]

    code = head_accept.main(["--model", "tiny-deepseek", "--before", str(start), "--after", str(trained),
                             "--prompts", str(heldout_file), "--max-new-tokens", str(HELDOUT_TOKENS), "--logs",
                             str(server_logs), "--json", *TREE])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    before, after = report["before"]["accept_length"], report["after"]["accept_length"]
    assert after > before + 0.5, report
    reference = SpeculativeDecoder(loaded.model, load_mtp_head(trained, loaded.model),
                                   TreePolicy("chain", budget=3, depth=3, topk=1))
    output = reference.generate(prompts[48:], GenerationConfig(max_new_tokens=HELDOUT_TOKENS,
                                                               eos_token_ids=loaded.eos_token_ids))
    print(f"\naccept length: start {before:.3f}, trained {after:.3f} through SGLang, "
          f"{output.accept_length_mean:.3f} in the reference decoder")
    assert after == pytest.approx(output.accept_length_mean, rel=0.05)


def test_smollm2_capture_of_chat_prompts(smollm2_cpu, server_logs, smollm2, tmp_path, capsys):
    with running_server(smollm2_cpu, server_logs, "smollm2-capture", CAPTURE_FLAGS, speculative=False) as server:
        capture_twice(server.url, "smollm2", "humaneval:130-132", tmp_path / "capture", 12, capsys)
    manifest = read_manifest(tmp_path / "capture")
    assert (manifest.model, manifest.hidden_size, manifest.num_sequences) == ("smollm2", 576, 3)
    loaded, _ = smollm2
    specs = humaneval_prompts(130, 132)
    for spec, sequence in zip(specs, iter_captured(tmp_path / "capture")):
        # the chat template's prompt, as training encodes it (one user message)
        assert sequence.id == spec.id
        assert sequence.tokens[: sequence.completion_start].tolist() == loaded.encode_prompt(
            spec.messages[0]["content"])
    assert_states_are_the_targets(loaded, tmp_path / "capture", 1e-2)
    out = tmp_path / "head.safetensors"
    assert main(["train", "--capture", str(tmp_path / "capture"), "--out", str(out), *TRAIN]) == 0
    assert json.loads(capsys.readouterr().out)["train_sequences"] == 3 and out.exists()


def test_smollm2_capture_train_on_two_processes_export_and_serve(smollm2_cpu, server_logs, smollm2, tmp_path,
                                                                  capsys):
    """The closed loop for SmolLM2, on a CI budget: one server drafting with the head it starts from (a fresh one,
    exported as the Llama draft) captures HumanEval 0-31 (the chat prompts' states plus 16 greedy answer tokens
    each) and measures that head's accept length on held-out HumanEval 130-135; the head trains 20 steps on 2
    processes (torchrun, FSDP2, bf16 autocast) and is served in its turn (``head_accept``). Served, its accept length
    is within 5% of the same head's in the reference decoder and clearly above the starting head's (a fresh head
    accepts almost nothing: 1.0; trained, ~1.4)."""
    loaded, _ = smollm2
    torch.manual_seed(0)
    start = save_mtp_head(MTPHead.for_target(loaded.model), tmp_path / "start.safetensors",
                          metadata={"model": "smollm2"})
    heldout = [loaded.encode_prompt(spec.messages[0]["content"]) for spec in humaneval_prompts(130, 135)]
    greedy = {"temperature": 0, "max_new_tokens": HELDOUT_TOKENS}
    capture = tmp_path / "capture"
    # one server for the capture and the "before" measurement: a second server start costs more (~30 s) than
    # capturing with speculation on
    served_start = head_accept.export_head(smollm2_cpu, str(start), tmp_path / "start-draft")
    with running_server(served_start, server_logs, "smollm2-loop-start", [*CAPTURE_FLAGS, *TREE]) as server:
        assert main(["capture", "--from-server", server.url, "--model", "smollm2", "--prompts", "humaneval:0-31",
                     "--out", str(capture), "--max-new-tokens", "16", "--batch-size", "16", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["captured"] == 32
        before, _ = head_accept.accept_length(server.generate(heldout, greedy))
    # captured while speculating, the states are still the target's
    with torch.no_grad():
        for sequence in islice(iter_captured(capture), 2):
            hidden = loaded.model.model(input_ids=sequence.tokens[None], use_cache=False).last_hidden_state[0, :-1]
            assert (sequence.hidden.float() - hidden).abs().max() / hidden.abs().max() < 1e-2, sequence.id

    trained = tmp_path / "trained.safetensors"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "sglang_spec.cli", "train", "--capture", str(capture), "--init", str(start), "--out", str(trained),
               "--draft-vocab", "1024", "--steps", "20", "--batch-size", "8", "--checkpoint-every", "20",
               "--unroll", "2", "--lr", "0.002", "--bf16", "--eval-fraction", "0", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["world_size"] == 2

    served = head_accept.serve_and_measure(smollm2_cpu, str(trained), heldout, HELDOUT_TOKENS, TREE,
                                           server_logs / "smollm2-loop-trained.log", tmp_path / "trained-draft")
    after = served.accept_length
    reference = SpeculativeDecoder(loaded.model, load_mtp_head(trained, loaded.model),
                                   TreePolicy("chain", budget=3, depth=3, topk=1))
    output = reference.generate(heldout, GenerationConfig(max_new_tokens=HELDOUT_TOKENS,
                                                          eos_token_ids=loaded.eos_token_ids))
    print(f"\naccept length: start {before:.3f}, trained {after:.3f} through SGLang ({served.verify_steps} verify "
          f"steps), {output.accept_length_mean:.3f} in the reference decoder")
    assert after > before + 0.2, (before, after)
    assert after == pytest.approx(output.accept_length_mean, rel=0.05)
