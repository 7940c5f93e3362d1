"""The captured dataset (shards, manifest, resume) and ``sglang-spec capture``'s client against a stand-in HTTP
server: what it stores from SGLang's answers, and one error line for each way a server or an input is wrong.
The real server is in tests/sglang_server/test_capture_from_server.py."""

from __future__ import annotations

import http.server
import json
import threading

import pytest
import torch

from captured import tiny_manifest, toy_sequences, write_capture
from sglang_spec.cli import main
from sglang_spec.errors import SpecError
from sglang_spec.train.capture import (MANIFEST, CapturedSequence, CaptureWriter, iter_captured, read_manifest,
                                       write_shard)


def test_shards_round_trip_and_a_reopened_writer_knows_what_is_done(tiny, tmp_path):
    sequences = toy_sequences(tiny[0], 5)
    folder = write_capture(tmp_path / "capture", sequences, shard_size=2)
    manifest = read_manifest(folder)
    assert [entry.sequences for entry in manifest.shards] == [2, 2, 1]
    assert manifest.num_tokens == 5 * 24 and manifest.hidden_size == 64 and manifest.dtype == "float16"
    stored = list(iter_captured(folder))
    assert [s.id for s in stored] == [s.id for s in sequences]
    for original, back in zip(sequences, stored):
        assert torch.equal(original.tokens, back.tokens) and back.completion_start == 6
        assert back.hidden.dtype == torch.float16 and back.hidden.shape == (23, 64)
        torch.testing.assert_close(back.hidden.float(), original.hidden, atol=4e-3, rtol=1e-3)
    writer = CaptureWriter(folder, tiny_manifest(), shard_size=2)
    assert writer.done == {s.id for s in sequences} and len(writer.manifest.shards) == 3


def test_a_shard_the_manifest_does_not_name_is_ignored_and_replaced(tiny, tmp_path):
    sequences = toy_sequences(tiny[0], 3)
    folder = write_capture(tmp_path / "capture", sequences[:2], shard_size=2)
    # an interrupted capture: its next shard was written, the manifest never named it
    write_shard(folder / "shard-00001.safetensors", sequences[2:], torch.float16)
    assert [s.id for s in iter_captured(folder)] == ["toy/0", "toy/1"]
    writer = CaptureWriter(folder, tiny_manifest(), shard_size=2)
    assert "toy/2" not in writer.done
    writer.add(sequences[2])
    writer.flush()
    assert [s.id for s in iter_captured(folder)] == ["toy/0", "toy/1", "toy/2"]


def test_bad_datasets_and_sequences_fail_in_one_line(tiny, tmp_path):
    sequences = toy_sequences(tiny[0], 2)
    folder = write_capture(tmp_path / "capture", sequences)
    with pytest.raises(SpecError, match="holds a capture with model tiny-deepseek, not smollm2"):
        CaptureWriter(folder, tiny_manifest(model="smollm2"), 4)
    with pytest.raises(SpecError, match="dtype float16, not float32"):
        CaptureWriter(folder, tiny_manifest(dtype="float32"), 4)
    with pytest.raises(SpecError, match="5 tokens need 4 hidden states"):
        CapturedSequence("x", "toy", torch.arange(5), 2, torch.zeros(5, 64))
    (folder / "shard-00000.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SpecError, match="damaged capture shard"):
        list(iter_captured(folder))
    (folder / "shard-00000.safetensors").unlink()
    with pytest.raises(SpecError, match="shard 'shard-00000.safetensors' is missing"):
        read_manifest(folder)
    with pytest.raises(SpecError, match="not a captured dataset"):
        read_manifest(tmp_path)


class _FakeSGLang:
    """``/model_info`` and ``/generate`` as SGLang answers them with ``return_hidden_states``: the prompt's states,
    then one per decode step. ``mode`` breaks one thing: "no_hidden", "cached" (a cached prompt prefix),
    "chunked" (a prompt sent with others prefilled in chunks: states of its last chunk only), "chunked_alone" (the
    same for a prompt sent alone too)."""

    def __init__(self, model_type: str = "deepseek_v3", mode: str = "ok", new_tokens: int = 4):
        outer = self
        self.requests: list[dict] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self._send({"model_path": "/served/model", "model_type": outer.model_type})

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(payload)
                self._send([outer.answer(ids, len(payload["input_ids"])) for ids in payload["input_ids"]])

            def _send(self, data):
                body = json.dumps(data).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.model_type, self.mode, self.new_tokens = model_type, mode, new_tokens
        self.httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def answer(self, prompt: list[int], batch: int = 1) -> dict:
        output = [(sum(prompt) + step) % 500 + 2 for step in range(self.new_tokens)]
        # row i of the states encodes its position, so the test can see they are stored in order
        rows = [[float(i)] * 64 for i in range(len(prompt) + len(output) - 1)]
        cached = 2 if self.mode == "cached" else 0  # SGLang computes (and returns) no state for cached tokens
        meta = {"finish_reason": {"type": "length"}, "cached_tokens": cached}
        chunked = self.mode == "chunked_alone" or (self.mode == "chunked" and batch > 1)
        first = cached or (2 if chunked else 0)  # SGLang returns the last prefill chunk's states only
        if self.mode != "no_hidden":
            meta["hidden_states"] = [rows[first : len(prompt)], *rows[len(prompt) :]]
        return {"output_ids": output, "meta_info": meta}

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": text, "domain": "toy"}) + "\n"
                            for text in ("abc abc", "hello", "one two one", "xyz")))
    return path


def test_capture_stores_prompt_answer_and_states_and_resumes(tmp_path, prompt_file, capsys):
    out = tmp_path / "capture"
    args = ["capture", "--model", "tiny-deepseek", "--prompts", str(prompt_file), "--out", str(out),
            "--max-new-tokens", "4", "--batch-size", "3", "--shard-size", "2", "--json"]
    with _FakeSGLang() as server:
        assert main([*args, "--from-server", server.url]) == 0
        first = json.loads(capsys.readouterr().out)
        assert first["captured"] == 4 and first["shards"] == 2 and first["tokens"] == 7 + 5 + 11 + 3 + 4 * 4
        assert server.requests[0]["return_hidden_states"] is True
        assert server.requests[0]["sampling_params"] == {"max_new_tokens": 4, "temperature": 0.0}
        stored = list(iter_captured(out))
        assert stored[1].tokens[:5].tolist() == [2 + ord(c) for c in "hello"]  # the byte tokenizer's ids
        assert stored[1].completion_start == 5 and stored[1].tokens[5:].tolist() == server.answer(
            stored[1].tokens[:5].tolist())["output_ids"]
        assert stored[1].hidden[:, 0].tolist() == list(range(8))  # prompt rows then decode rows, in order
        manifest = read_manifest(out)
        assert manifest.source["server"] == server.url and manifest.source["server_model_path"] == "/served/model"
        # the same command again skips every stored prompt
        assert main([*args, "--from-server", server.url]) == 0
        again = json.loads(capsys.readouterr().out)
        assert again["captured"] == 0 and again["skipped"] == 4 and again["sequences"] == 4
        assert len(server.requests) == 2
        # resuming with other sampling would mix two datasets in one
        assert main([*args, "--from-server", server.url, "--temperature", "0.7"]) == 2
        assert "was captured with sampling" in capsys.readouterr().err


def test_a_prompt_chunked_beside_others_is_sent_again_alone(tmp_path, prompt_file, capsys):
    with _FakeSGLang(mode="chunked") as server:
        assert main(["capture", "--from-server", server.url, "--model", "tiny-deepseek", "--prompts",
                     str(prompt_file), "--out", str(tmp_path / "capture"), "--batch-size", "2", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["captured"] == 4
        assert [len(request["input_ids"]) for request in server.requests] == [2, 1, 1, 2, 1, 1]
    stored = list(iter_captured(tmp_path / "capture"))
    assert all(sequence.hidden[:, 0].tolist() == list(range(len(sequence.tokens) - 1)) for sequence in stored)


@pytest.mark.parametrize("server_kind, message", [
    (dict(mode="no_hidden"), "launch it with --enable-return-hidden-states"),
    (dict(mode="cached"), "2 were cached, and SGLang returns states only for the tokens it computes); launch it "
                          "with --disable-radix-cache"),
    (dict(model_type="llama"), "serves a llama model, but tiny-deepseek is deepseek_v3"),
    (dict(mode="chunked_alone"), "(it prefilled the prompt in chunks and returns states of the last chunk only); "
                                 "launch it with --chunked-prefill-size above 7"),
])
def test_a_server_that_cannot_be_captured_fails_in_one_line(tmp_path, prompt_file, capsys, server_kind, message):
    with _FakeSGLang(**server_kind) as server:
        code = main(["capture", "--from-server", server.url, "--model", "tiny-deepseek", "--prompts",
                     str(prompt_file), "--out", str(tmp_path / "capture"), "--json"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("extra, message", [
    (["--from-server", "localhost:1"], "give the server's URL, e.g. http://127.0.0.1:30000"),
    (["--from-server", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9"),
    (["--from-server", "http://127.0.0.1:9", "--max-new-tokens", "0"], "argument --max-new-tokens"),
    (["--from-server", "http://127.0.0.1:9", "--prompts", "nowhere.jsonl"], "unknown prompt set 'nowhere.jsonl'"),
])
def test_bad_input_fails_in_one_line(tmp_path, prompt_file, capsys, extra, message):
    code = main(["capture", "--model", "tiny-deepseek", "--prompts", str(prompt_file), "--out",
                 str(tmp_path / "capture"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_out_must_be_a_dataset_folder(tmp_path, prompt_file, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    for out, message in ((tmp_path / "file", "is a file"), (tmp_path / "other", "holding other files")):
        code = main(["capture", "--from-server", "http://127.0.0.1:9", "--model", "tiny-deepseek", "--prompts",
                     str(prompt_file), "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and message in err, err
    assert (tmp_path / "other" / "notes.txt").exists() and not (tmp_path / "other" / MANIFEST).exists()
