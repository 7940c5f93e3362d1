"""The mission's model family on this CPU: a tiny DeepSeek-V3 (MLA + MoE + its own MTP layer) through SGLang's
DeepseekV3ForCausalLM and ``--speculative-algorithm NEXTN`` (SGLang loads the MTP layer as
DeepseekV3ForCausalLMNextN), with the plugin's trees over an MLA draft pool.

Greedy output equals plain decoding for every policy; the accept length matches the reference decoder's; a
sampled run (temperature 0.7) goes through SGLang's sampling verify and is reproducible with a seed; the tree
options work as ``sgl.Engine`` keywords; ``--speculative-tree-accept fused`` (the project's verify + accept
kernels and KV commit, run by the Triton interpreter here) gives exactly SGLang's own accept's outputs, greedy and
seeded-sampled, for every policy, and leaves the batches it does not serve to SGLang's path, counted.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from cpu_server_helpers import accept_lengths, mean, running_server, tree_args
from sglang_spec_testbed import server_environment
from sglang_spec.sglang_plugin.fused_accept import ACCEPT_KERNELS_ENV

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

MAX_NEW_TOKENS = 32
SHAPES = [("chain", 3, 3, 1), ("eagle", 15, 4, 4), ("sequoia", 8, 3, 2), ("specexec", 6, 3, 2)]
SEED = ["--random-seed", "7"]  # the same seed for SGLang's accept and the fused one: the same coins
SAMPLED = {"temperature": 0.7, "max_new_tokens": MAX_NEW_TOKENS}
PENALIZED = {"temperature": 0, "max_new_tokens": 8, "frequency_penalty": 0.5}


@pytest.fixture(scope="module")
def prompts(tiny_prompts) -> list[list[int]]:
    return tiny_prompts


@pytest.fixture(scope="module")
def plain(tiny_plain) -> list[list[int]]:
    return tiny_plain


@dataclass(frozen=True)
class Served:
    """One server's answers to the same requests in the same order: greedy, temperature 0.7, and a greedy batch
    with a frequency penalty (SGLang's accept must serve it); its /metrics text when metrics were on; its log."""

    shape: tuple
    greedy: list[dict]
    sampled: list[dict]
    penalized: list[dict]
    metrics: str
    log: str


def serve(tiny_cpu, server_logs, prompts, shape, extra, name) -> Served:
    with running_server(tiny_cpu, server_logs, name, extra) as server:
        greedy = server.generate(prompts, {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS})
        sampled = server.generate(prompts, SAMPLED)
        penalized = server.generate(prompts[:2], PENALIZED)
        metrics = server.request("/metrics") if "--enable-metrics" in extra else ""
    return Served(shape, greedy, sampled, penalized, metrics, server.log_path.read_text(errors="replace"))


@pytest.fixture(scope="module", params=SHAPES, ids=lambda shape: "{}-{}-{}-{}".format(*shape))
def tree_answers(request, tiny_cpu, server_logs, prompts, smollm2_cpu) -> Served:
    # any profile gives sequoia a shape to lay over the draft slots; the SmolLM2 head's is at hand
    extra = tree_args(*request.param, smollm2_cpu.profile) + SEED
    return serve(tiny_cpu, server_logs, prompts, request.param, extra, "tiny-{}-{}-{}-{}".format(*request.param))


def test_greedy_output_equals_plain_decoding(tree_answers, plain):
    shape, answers = tree_answers.shape, tree_answers.greedy
    assert [answer["output_ids"] for answer in answers] == plain, f"{shape}"
    assert max(accept_lengths(answers)) >= 2


def test_accept_length_matches_the_reference_decoder(tree_answers, prompts, tiny):
    """SGLang drafts with the checkpoint's MTP layer exactly as the reference decoder does when the fed-back
    hidden state is the post-norm one (SGLang's NextN feeds back shared_head.norm's output)."""
    shape, answers = tree_answers.shape, tree_answers.greedy
    if shape[0] not in ("chain", "eagle"):
        pytest.skip("sequoia / specexec: compared with the reference decoder in test_own_draft_loop.py (SmolLM2)")
    from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder
    from sglang_spec.models.loading import load_head_for
    from sglang_spec.tree import TreePolicy

    loaded, _ = tiny
    head = load_head_for(loaded, None, feedback="post_norm")
    policy, budget, depth, topk = shape
    reference = SpeculativeDecoder(loaded.model, head, TreePolicy(policy, budget=budget, depth=depth, topk=topk))
    output = reference.generate(prompts, GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, eos_token_ids=()))
    through_sglang = mean(accept_lengths(answers))
    print(f"\n{shape} mean accept length: SGLang {through_sglang:.3f}, reference {output.accept_length_mean:.3f}")
    assert through_sglang == pytest.approx(output.accept_length_mean, rel=0.10)


def test_sampled_run_is_sampled(tree_answers, plain):
    """Temperature 0.7 through SGLang's sampling verify (tree_speculative_sampling_target_only): full-length
    outputs that are not the greedy ones, with drafts accepted. (That a seed reproduces them across servers is
    shown by the fused-accept comparison below: two servers, the same --random-seed, the same tokens.)"""
    tokens = [answer["output_ids"] for answer in tree_answers.sampled]
    assert tokens != plain
    assert all(len(row) == MAX_NEW_TOKENS for row in tokens)
    assert mean(accept_lengths(tree_answers.sampled)) > 1.0


ENGINE_SCRIPT = """
import json, sys
import sglang as sgl
engine = sgl.Engine(model_path=sys.argv[1], device="cpu", attention_backend="intel_amx", dtype="float32",
                    skip_tokenizer_init=True, mem_fraction_static=0.3, max_total_tokens=4096,
                    cuda_graph_backend_decode="disabled", cuda_graph_backend_prefill="disabled",
                    speculative_algorithm="NEXTN", speculative_tree_policy="eagle", speculative_tree_budget=6,
                    speculative_tree_depth=3, speculative_tree_topk=2)
out = engine.generate(input_ids=json.loads(sys.argv[2]), sampling_params={"temperature": 0, "max_new_tokens": 32})
print("RESULT " + json.dumps([o["output_ids"] for o in out]))
engine.shutdown()
"""


def test_tree_options_as_engine_keywords(tiny_cpu, prompts, plain):
    """sgl.Engine(..., speculative_tree_policy=...) in a fresh process: the keywords reach the draft worker."""
    finished = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(tiny_cpu.target_dir), json.dumps(prompts)],
                              env=server_environment(), capture_output=True, text=True, timeout=300)
    lines = [line for line in finished.stdout.splitlines() if line.startswith("RESULT ")]
    assert finished.returncode == 0 and lines, finished.stderr[-3000:]
    assert json.loads(lines[0][len("RESULT "):]) == plain
    assert "Traceback" not in finished.stderr


@pytest.fixture(scope="module")
def fused_answers(tree_answers, tiny_cpu, server_logs, prompts, smollm2_cpu) -> Served:
    """The same shape served with --speculative-tree-accept fused (metrics on), the same requests in the same order.
    These servers run the Triton kernels themselves, interpreted (the tiny vocabulary keeps that cheap); the bed's
    other fused servers run their pure-torch references (``SGLANG_SPEC_ACCEPT_KERNELS``)."""
    shape = tree_answers.shape
    extra = tree_args(*shape, smollm2_cpu.profile) + SEED + ["--speculative-tree-accept", "fused", "--enable-metrics"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ACCEPT_KERNELS_ENV, "triton")
        return serve(tiny_cpu, server_logs, prompts, shape, extra, "tiny-fused-{}-{}-{}-{}".format(*shape))


def _counter(metrics: str, outcome: str) -> float:
    found = re.search(r'^sglang_spec_fused_accept_batches_total\{outcome="%s"\} ([0-9.]+)$' % outcome, metrics, re.M)
    return float(found.group(1)) if found else 0.0


def test_fused_accept_equals_sglangs_accept(tree_answers, fused_answers):
    """Greedy and seeded sampling: our verify + accept kernels and KV commit give exactly the tokens and accept
    lengths of SGLang's eagle_sample + move_accept_tokens_to_target_kvcache, and served those batches."""
    for ours, theirs in ((fused_answers.greedy, tree_answers.greedy), (fused_answers.sampled, tree_answers.sampled)):
        assert [a["output_ids"] for a in ours] == [a["output_ids"] for a in theirs], f"{tree_answers.shape}"
        assert accept_lengths(ours) == accept_lengths(theirs)
    assert [a["output_ids"] for a in tree_answers.sampled] != [a["output_ids"] for a in tree_answers.greedy]
    assert _counter(fused_answers.metrics, "fused") > 0
    assert "fused accept: the kernels' pure-torch references" not in fused_answers.log  # the Triton kernels ran


def test_fused_accept_falls_back_per_batch_with_a_counter(tree_answers, fused_answers):
    """A batch with a frequency penalty is SGLang's to accept: the fused server counts it on /metrics and its
    output is SGLang's."""
    assert [a["output_ids"] for a in fused_answers.penalized] == [a["output_ids"] for a in tree_answers.penalized]
    assert _counter(fused_answers.metrics, "penalties") > 0


def test_fused_accept_feeds_the_per_rank_counts(fused_answers):
    """The per-(depth, rank) counters see the fused accept's paths too: over the server's life (its warm-up steps
    included) they count exactly the steps, and per depth the accepted nodes, of its per-position counters (SGLang's
    per-request histograms), so 1 + accepted nodes per step is the mean accept length."""
    from sglang_spec.cli.calibrate import parse_rank_counts

    metrics = fused_answers.metrics
    steps, offered, accepted = parse_rank_counts(metrics)
    assert steps == _metric(metrics, "sglang_spec_tree_verify_steps_total") and offered[(1, 0)] == steps
    assert steps >= len(accept_lengths(fused_answers.greedy + fused_answers.sampled + fused_answers.penalized))
    for depth in range(1, fused_answers.shape[2] + 1):
        at_least = _metric(metrics, f'sglang_spec_tree_accepted_drafts_total{{position="{depth}"}}')
        assert sum(count for (d, _), count in accepted.items() if d == depth) == at_least, f"depth {depth}"


def _metric(metrics: str, sample: str) -> float:
    found = re.search(rf"^{re.escape(sample)} ([0-9.e+]+)$", metrics, re.M)
    return float(found.group(1)) if found else 0.0
