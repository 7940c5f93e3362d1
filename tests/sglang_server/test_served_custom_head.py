"""The closed loop through SGLang's real server on this CPU, for the tiny DeepSeek-V3: capture from a server →
2-process training (torchrun, FSDP2) → export in DeepSeek's layout → served by NEXTN. The served head's accept
length through the server is within 5% of the same head's in the reference decoder, and higher than the head it
started from, on held-out prompts of the captured domain (``head_accept``: one command, both numbers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from cpu_server_helpers import running_server
from sglang_spec.cli import main
from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder
from sglang_spec.models.loading import ByteTokenizer
from sglang_spec.models.toy_language import ToyLanguage
from sglang_spec.mtp.checkpoint import load_mtp_head, save_mtp_head
from sglang_spec.mtp.head import MTPHead
from sglang_spec.sglang_plugin import head_accept
from sglang_spec.tree import TreePolicy

NEW_TOKENS = 24
TREE = ["--speculative-tree-policy", "chain", "--speculative-tree-budget", "3", "--speculative-tree-depth", "3"]


def write_prompts(path, prompts):
    path.write_text("".join(json.dumps({"prompt": ByteTokenizer().decode(p), "domain": "toy"}) + "\n"
                            for p in prompts))
    return path


def test_capture_train_on_two_processes_export_and_serve(tiny_cpu, server_logs, tiny, tmp_path, capsys):
    loaded, _ = tiny
    language = ToyLanguage(512, seed=123)  # the language tiny-deepseek was trained on
    prompts = [language.sample(1, 6)[0].tolist() for _ in range(54)]
    train_file, heldout_file = write_prompts(tmp_path / "train.jsonl", prompts[:48]), write_prompts(
        tmp_path / "heldout.jsonl", prompts[48:])
    capture = tmp_path / "capture"
    with running_server(tiny_cpu, server_logs, "tiny-loop-capture",
                        ["--enable-return-hidden-states", "--disable-radix-cache"], speculative=False) as server:
        assert main(["capture", "--from-server", server.url, "--model", "tiny-deepseek", "--prompts",
                     str(train_file), "--out", str(capture), "--max-new-tokens", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["captured"] == 48

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
                             "--prompts", str(heldout_file), "--max-new-tokens", str(NEW_TOKENS), "--logs",
                             str(server_logs), "--json", *TREE])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    before, after = report["before"]["accept_length"], report["after"]["accept_length"]
    assert after > before + 0.5, report

    head = load_mtp_head(trained, loaded.model)
    reference = SpeculativeDecoder(loaded.model, head, TreePolicy("chain", budget=3, depth=3, topk=1))
    output = reference.generate(prompts[48:], GenerationConfig(max_new_tokens=NEW_TOKENS,
                                                               eos_token_ids=loaded.eos_token_ids))
    print(f"\naccept length: start {before:.3f}, trained {after:.3f} through SGLang, "
          f"{output.accept_length_mean:.3f} in the reference decoder")
    assert after == pytest.approx(output.accept_length_mean, rel=0.05)
