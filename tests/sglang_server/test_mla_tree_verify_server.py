"""``--speculative-tree-mla-verify flashinfer`` through SGLang's real server on this CPU: the tiny DeepSeek-V3 (MLA
+ MoE + MTP) verifies its trees with the FlashInfer cascade (the CPU twin of FlashInfer's paged MLA decode over the
prefix, the interpreted tree kernel over the tree, the base-2 merge), prefill and decode on the bed's intel_amx.

Greedy output equals plain decoding token for token; the verify forwards' log-probabilities equal (float32
tolerance) those of the bed's existing MLA tree verify (SGLang's intel_amx extend attention with the tree mask,
the stand-in ``extend_attention_cpu``), step for step (same accept lengths), in SGLang's CPU mask layout
(QLEN_ONLY) and in the GPU's (FULL_MASK, ``SGLANG_SPEC_CPU_TREE_MASK=full``) with pages of 4 tokens, and with
tensor parallelism 2 (two heads a rank, gloo); seeded temperature-0.7 requests give the bed's sampled tokens (one
rank: the same coins on the same logits); the server logs that the cascade served its verifies; and a launch it
cannot serve (a model without MLA, a quantized KV cache) is refused in one line. Host-built (``lookup``) trees are
verified ragged through the cascade (each request's forward covers its own tree, ``ragged_verify``): greedy output
plain decoding's, every token's log-probability the bed's ragged verify's.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from cpu_server_helpers import accept_lengths, counter, running_server, tree_args
from sglang_spec_testbed import server_environment
from sglang_spec_testbed.server import cpu_launch_args, free_port
from sglang_spec_testbed.tree_mask import TREE_MASK_ENV

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

MAX_NEW_TOKENS = 24
SHAPE = ("eagle", 6, 3, 2)  # a real tree: two children a node, three levels
CASCADE = ["--speculative-tree-mla-verify", "flashinfer"]
SEED = ["--random-seed", "7"]  # every tree server: the same coins for the same logits
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS}
SAMPLED = {"temperature": 0.7, "max_new_tokens": MAX_NEW_TOKENS}
FIRST_VERIFY = "MLA tree verify on FlashInfer: first verify forward"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from sglang_spec.models.tiny_deepseek import TINY_DEEPSEEK_CONFIG
    from sglang_spec.models.toy_language import ToyLanguage

    return ToyLanguage(TINY_DEEPSEEK_CONFIG["vocab_size"], seed=999).sample(3, 10).tolist()


@dataclass(frozen=True)
class Served:
    """One server's greedy answers with the log-probability of every output token (SGLang reads them from the
    target's verify logits on a tree server), its seeded sampled answers (tree servers), and its log."""

    greedy: list[dict]
    sampled: list[dict]
    log: str
    metrics: str = ""  # /metrics after the requests, where the server was launched with --enable-metrics


def serve(tiny_cpu, server_logs, prompts, name, extra=(), speculative=True, environment=None) -> Served:
    with pytest.MonkeyPatch.context() as patch:
        for variable, value in (environment or {}).items():
            patch.setenv(variable, value)
        with running_server(tiny_cpu, server_logs, name, list(extra), speculative=speculative) as server:
            greedy = server.request("/generate", {"input_ids": prompts, "sampling_params": GREEDY,
                                                  "return_logprob": True})
            sampled = server.generate(prompts, SAMPLED) if speculative else []
            metrics = server.request("/metrics") if "--enable-metrics" in extra else ""
            log = server.log_path.read_text(errors="replace")
    return Served(greedy, sampled, log, metrics)


def token_logprobs(answer: list[dict]) -> list[list[float]]:
    return [[entry[0] for entry in item["meta_info"]["output_token_logprobs"]] for item in answer]


@pytest.fixture(scope="module")
def plain(tiny_cpu, server_logs, prompts):
    return serve(tiny_cpu, server_logs, prompts, "mla-plain", speculative=False).greedy


@pytest.fixture(scope="module")
def bed_tree(tiny_cpu, server_logs, prompts) -> Served:
    """The bed's existing MLA tree verify (intel_amx extend attention, tree mask) with the same tree."""
    return serve(tiny_cpu, server_logs, prompts, "mla-bed-tree", tree_args(*SHAPE) + SEED)


@pytest.fixture(scope="module", params=["qlen-page1", "full-page4", "qlen-tp2"])
def cascade(request, tiny_cpu, server_logs, prompts) -> tuple[str, Served]:
    extra = tree_args(*SHAPE) + SEED + CASCADE
    environment = {}
    if request.param == "full-page4":
        extra += ["--page-size", "4"]
        environment[TREE_MASK_ENV] = "full"
    if request.param == "qlen-tp2":
        extra += ["--tp-size", "2"]
    return request.param, serve(tiny_cpu, server_logs, prompts, f"mla-cascade-{request.param}", extra,
                                environment=environment)


def test_greedy_output_equals_plain_decoding(cascade, plain):
    name, served = cascade
    answer = served.greedy
    assert [item["output_ids"] for item in answer] == [item["output_ids"] for item in plain], name
    assert max(accept_lengths(answer)) >= 2  # trees were accepted past the root


def test_verify_logprobs_equal_the_beds_mla_tree_verify(cascade, bed_tree):
    """Same tokens, same accept lengths (the same verify steps), and every output token's log-probability (read
    from the verify logits) equal to float32 tolerance: the cascade computes the bed's masked attention."""
    name, served = cascade
    answer, bed_answer = served.greedy, bed_tree.greedy
    assert [item["output_ids"] for item in answer] == [item["output_ids"] for item in bed_answer], name
    assert accept_lengths(answer) == accept_lengths(bed_answer), name
    ours, theirs = token_logprobs(answer), token_logprobs(bed_answer)
    assert [len(row) for row in ours] == [len(row) for row in theirs]
    worst = max(abs(a - b) for row_a, row_b in zip(ours, theirs) for a, b in zip(row_a, row_b))
    print(f"\n{name}: largest log-probability difference to the bed's MLA tree verify {worst:.2e}")
    assert worst < 1e-4, name
    assert any(value < -1e-3 for row in ours for value in row)  # real distributions, not all-certain tokens


def test_sampled_requests_through_the_cascade(cascade, bed_tree):
    """Seeded temperature 0.7 through SGLang's sampling verify on the cascade's logits: full length, drafts
    accepted, not the greedy tokens; on one rank exactly the bed's tokens (same seed, same coins, same logits)."""
    name, served = cascade
    tokens = [item["output_ids"] for item in served.sampled]
    assert all(len(row) == MAX_NEW_TOKENS for row in tokens) and max(accept_lengths(served.sampled)) >= 2, name
    assert tokens != [item["output_ids"] for item in served.greedy]
    if not name.endswith("tp2"):
        assert tokens == [item["output_ids"] for item in bed_tree.sampled], name


def test_the_cascade_served_the_verifies(cascade, bed_tree):
    name, served = cascade
    heads = "2 heads" if name.endswith("tp2") else "4 heads"
    assert f"MLA tree verify on FlashInfer (CPU twin): {heads}" in served.log and FIRST_VERIFY in served.log, name
    if name.startswith("full"):
        assert "first FULL_MASK tree mask built" in served.log
    assert FIRST_VERIFY not in bed_tree.log


LOOKUP = tree_args("lookup", 6, 6, 2) + SEED + ["--enable-metrics"]  # context trees: each its own size
RAGGED_ON = "ragged verify: each request's verify forward covers its own tree"


@pytest.fixture(scope="module")
def bed_lookup(tiny_cpu, server_logs, prompts) -> Served:
    """lookup trees verified ragged through the bed's intel_amx extend attention."""
    return serve(tiny_cpu, server_logs, prompts, "mla-bed-lookup", LOOKUP)


@pytest.fixture(scope="module", params=["tp1", "tp2"])
def cascade_lookup(request, tiny_cpu, server_logs, prompts) -> Served:
    """lookup trees verified ragged through the cascade, on one rank and on two (two heads a rank, gloo)."""
    tensor_parallel = ["--tp-size", "2"] if request.param == "tp2" else []
    return serve(tiny_cpu, server_logs, prompts, f"mla-cascade-lookup-{request.param}",
                 LOOKUP + CASCADE + tensor_parallel)


def test_the_cascade_verifies_host_trees_ragged(cascade_lookup, bed_lookup, plain):
    """Each request's verify forward covers its own tree (fewer tokens than SGLang's width a request), the
    cascade's tree halves read each request's rows and cut mask: greedy output plain decoding's, and the same
    accept lengths and log-probabilities (float32 tolerance) as the bed's ragged verify of the same trees on one
    rank (a mask block misread changes the cascade's output: ``tests/kernels/test_mla_tree_verify.py``'s ragged
    test and its negative control)."""
    cascade, bed = cascade_lookup, bed_lookup
    assert RAGGED_ON in cascade.log and FIRST_VERIFY in cascade.log and FIRST_VERIFY not in bed.log
    assert [item["output_ids"] for item in cascade.greedy] == [item["output_ids"] for item in plain]
    computed, dense = (counter(cascade.metrics, f"sglang_spec_verify_tokens_{kind}_total")
                       for kind in ("computed", "dense"))
    assert 0 < computed < dense, (computed, dense)
    assert max(accept_lengths(cascade.greedy)) >= 2  # copies were found and accepted
    assert accept_lengths(cascade.greedy) == accept_lengths(bed.greedy)
    ours, theirs = token_logprobs(cascade.greedy), token_logprobs(bed.greedy)
    worst = max(abs(a - b) for row_a, row_b in zip(ours, theirs) for a, b in zip(row_a, row_b))
    assert worst < 1e-4, worst


@pytest.mark.parametrize(
    "model, extra, message",
    [
        ("smollm2_cpu", tree_args("eagle", 8, 4, 4), "--speculative-tree-mla-verify serves MLA models"),
        ("tiny_cpu", tree_args(*SHAPE) + ["--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype is fp8_e4m3"),
    ],
    ids=["model-without-mla", "quantized-kv-cache"],
)
def test_refused_in_one_line(request, model, extra, message):
    command = [sys.executable, "-m", "sglang.launch_server",
               *cpu_launch_args(request.getfixturevalue(model), free_port(), extra=extra + CASCADE)]
    finished = subprocess.run(command, env=server_environment(), capture_output=True, text=True, timeout=240)
    errors = [line for line in finished.stderr.splitlines() if line.startswith("error: ")]
    assert finished.returncode != 0
    assert len(errors) == 1 and message in errors[0], finished.stderr[-2000:]
    assert "Traceback" not in finished.stderr + finished.stdout
