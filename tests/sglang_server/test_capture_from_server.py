"""``sglang-spec capture`` through SGLang's real server on this CPU: the stored tokens are the server's answers and
the stored states are the target's final hidden states (transformers computes the same ones from the stored
tokens), for the tiny DeepSeek-V3 served with speculation (NEXTN, its own MTP layer) and SmolLM2 served plainly;
a second capture resumes; a head trains from each capture without the target loaded."""

from __future__ import annotations

import json

import pytest
import torch

from cpu_server_helpers import running_server
from sglang_spec.cli import main
from sglang_spec.models.loading import ByteTokenizer
from sglang_spec.models.toy_language import ToyLanguage
from sglang_spec.train.capture import iter_captured, read_manifest
from sglang_spec.train.prompts import humaneval_prompts

CAPTURE_FLAGS = ["--enable-return-hidden-states", "--disable-radix-cache"]
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
            "--max-new-tokens", str(new_tokens), "--batch-size", "2", "--shard-size", "2", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["captured"] == 0 and again["skipped"] == first["captured"] == again["sequences"]
    return first


def test_tiny_deepseek_capture_from_a_speculating_server(tiny_cpu, server_logs, tiny, tmp_path, capsys):
    language = ToyLanguage(512, seed=123)
    prompts = tmp_path / "toy.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": ByteTokenizer().decode(language.sample(1, 6)[0].tolist())})
                               + "\n" for _ in range(4)))
    extra = [*CAPTURE_FLAGS, "--speculative-tree-policy", "chain", "--speculative-tree-budget", "3",
             "--speculative-tree-depth", "3"]
    with running_server(tiny_cpu, server_logs, "tiny-capture", extra) as server:
        first = capture_twice(server.url, "tiny-deepseek", prompts, tmp_path / "capture", 16, capsys)
        answers = server.generate([s.tokens[: s.completion_start].tolist() for s in iter_captured(tmp_path /
                                                                                                  "capture")],
                                  {"temperature": 0, "max_new_tokens": 16})
    assert first["captured"] == 4 and first["tokens"] == 4 * (6 + 16)
    stored = list(iter_captured(tmp_path / "capture"))
    assert [s.tokens[s.completion_start :].tolist() for s in stored] == [a["output_ids"] for a in answers]
    assert_states_are_the_targets(tiny[0], tmp_path / "capture", 2e-3)
    out = tmp_path / "head.safetensors"
    assert main(["train", "--capture", str(tmp_path / "capture"), "--out", str(out), *TRAIN]) == 0
    assert json.loads(capsys.readouterr().out)["train_sequences"] == 4 and out.exists()


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
