"""A head swapped into SGLang's real server on this CPU while it serves (``sglang-spec adapt``, ``hooks.adapt``).

One server (SmolLM2, the shipped generic head, a chain of 4, the traffic log, hidden states, metrics):

* requests in flight across swaps answer exactly what plain decoding answers, and the swaps took effect (the
  per-head counters count every head, the bad head's accept length is far below the good one's);
* the guard: a deliberately bad head offered to ``adapt`` is rolled back after its probation, and the requests
  served after the verdict are drafted by the launch head again at its accept length (with the guard disabled
  the bad head would stay and those requests would fail both checks);
* the traffic log holds the served requests as token ids and leaves out adapt's own captures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cpu_server_helpers import SMOLLM2_NEW_TOKENS, running_server
from sglang_spec.models.loading import shipped_head_path
from sglang_spec.sglang_plugin.export import export_llama_draft
from sglang_spec.train.adapt import ServedHead, swap_head
from sglang_spec.train.server_counts import parse_head_counts

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

TREE = ["--speculative-tree-policy", "chain", "--speculative-tree-budget", "4", "--speculative-tree-depth", "4"]
FLAGS = ["--enable-metrics", "--enable-return-hidden-states", "--disable-radix-cache"]


def generic_head() -> Path:
    return shipped_head_path("smollm2").with_name("smollm2-135m-instruct-generic.safetensors")


def bad_head(path: Path) -> Path:
    """The generic head with every weight replaced by seeded noise of the same scale: finite, the right model
    and vocabulary, and nearly useless as a drafter."""
    source = generic_head()
    with safe_open(str(source), "pt") as handle:
        metadata = handle.metadata()
    generator = torch.Generator().manual_seed(0)
    tensors = {name: tensor if name == "draft_vocab" else
               (torch.randn(tensor.shape, generator=generator) * tensor.float().std()).to(tensor.dtype)
               for name, tensor in load_file(str(source)).items()}
    save_file(tensors, str(path), metadata=metadata)
    return path


@pytest.fixture(scope="module")
def adapt_server(smollm2_cpu, server_logs, tmp_path_factory):
    work = tmp_path_factory.mktemp("adapt-server")
    export = export_llama_draft(generic_head(), smollm2_cpu.target_dir, work / "generic-draft")
    served = replace(smollm2_cpu, draft_args=tuple(export.server_args()))
    log = work / "traffic.jsonl"
    with running_server(served, server_logs, "smollm2-adapt",
                        [*TREE, *FLAGS, "--speculative-tree-traffic-log", str(log)]) as server:
        yield server, work, log


def accept_length(answers) -> float:
    steps = emitted = 0
    for answer in answers:
        histogram = answer["meta_info"].get("spec_correct_drafts_histogram") or []
        steps += sum(histogram)
        emitted += sum((drafts + 1) * count for drafts, count in enumerate(histogram))
    return emitted / steps


def test_swaps_with_requests_in_flight_keep_greedy_output(adapt_server, smollm2_prompts, smollm2_plain, tmp_path):
    server, work, log = adapt_server
    heads = ServedHead.of(generic_head())
    good, bad = heads.draft_tensors(generic_head()), heads.draft_tensors(bad_head(tmp_path / "bad.safetensors"))
    answers: list = []
    sent = threading.Thread(target=lambda: answers.extend(
        server.generate(smollm2_prompts, {"temperature": 0, "max_new_tokens": SMOLLM2_NEW_TOKENS})))
    sent.start()
    swaps = 0
    while sent.is_alive() or swaps < 2:  # at least two swaps, as many as fit while the batch decodes
        swap_head(server.url, bad if swaps % 2 == 0 else good, "bad" if swaps % 2 == 0 else "good", 1)
        swaps += 1
        time.sleep(0.5)
    sent.join()
    assert [answer["output_ids"] for answer in answers] == smollm2_plain
    counts = parse_head_counts(server.request("/metrics"))
    assert counts["bad"][0] > 0 and counts["good"][0] + counts["0"][0] > 0, counts
    # the swaps reached the draft: the noise head drafts far worse than the generic one on the same prompts
    swap_head(server.url, bad, "bad", 1)
    worse = accept_length(server.generate(smollm2_prompts[:2], {"temperature": 0, "max_new_tokens": 24}))
    swap_head(server.url, good, "0", 1)
    better = accept_length(server.generate(smollm2_prompts[:2], {"temperature": 0, "max_new_tokens": 24}))
    assert worse < 1.1 < better - 0.2, (worse, better)
    served = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(line["input_ids"] == smollm2_prompts[0] and line["output_ids"] == smollm2_plain[0] for line in served)


def test_the_guard_rolls_a_bad_head_back(adapt_server, smollm2_prompts, tmp_path):
    server, work, log = adapt_server
    request = {"temperature": 0, "max_new_tokens": 24}
    command = [sys.executable, "-m", "sglang_spec.cli", "adapt", "--from-server", server.url, "--traffic-log",
               str(log), "--model", "smollm2", "--head", str(generic_head()), "--work", str(tmp_path / "adapt"),
               "--offer", str(bad_head(tmp_path / "bad.safetensors")), "--verdicts", "1", "--probation-steps", "30",
               "--train-every", "64", "--window", "64", "--poll-seconds", "0.2"]
    adapt = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(40):  # the stream: the same prompts again and again until the verdict
            if adapt.poll() is not None:
                break
            server.generate(smollm2_prompts[:2], request)
        output, _ = adapt.communicate(timeout=120)
    finally:
        if adapt.poll() is None:
            adapt.kill()
    assert adapt.returncode == 0, output
    events = [json.loads(line) for line in (tmp_path / "adapt" / "events.jsonl").read_text().splitlines()]
    verdicts = [event for event in events if event["event"] in ("keep", "rollback")]
    assert [event["event"] for event in verdicts] == ["rollback"], output
    assert verdicts[0]["accept_length"] < verdicts[0]["previous_accept_length"]
    assert len([line for line in output.splitlines() if "rolled back" in line]) == 1
    # after the verdict the launch head drafts again, at the launch head's accept length
    offered = verdicts[0]["head"]  # it drafted (its verdict may land inside a request, which then reports "0")
    assert parse_head_counts(server.request("/metrics"))[offered][0] > 0
    after = server.generate(smollm2_prompts[:2], request)
    assert {answer["meta_info"]["weight_version"] for answer in after} == {"0"}
    assert accept_length(after) > verdicts[0]["accept_length"] + 0.2
    # adapt's own captures (prefills with hidden states) are not served traffic
    served = [json.loads(line) for line in log.read_text().splitlines()]
    assert served and all(len(line["output_ids"]) > 1 for line in served if not line["rid"].startswith("HEALTH"))
