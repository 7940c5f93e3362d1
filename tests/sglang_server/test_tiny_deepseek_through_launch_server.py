"""The mission's model family on this CPU: a tiny DeepSeek-V3 (MLA + MoE + its own MTP layer) through SGLang's
DeepseekV3ForCausalLM and ``--speculative-algorithm NEXTN`` (SGLang loads the MTP layer as
DeepseekV3ForCausalLMNextN), with the plugin's trees over an MLA draft pool.

Greedy output equals plain decoding for every policy; the accept length matches the reference decoder's; a
sampled run (temperature 0.7) goes through SGLang's sampling verify and is reproducible with a seed; the tree
options work as ``sgl.Engine`` keywords.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cpu_server_helpers import accept_lengths, mean, running_server, tree_args
from sglang_spec.sglang_plugin.cpu import server_environment

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

MAX_NEW_TOKENS = 32
SHAPES = [("chain", 3, 3, 1), ("eagle", 15, 4, 4), ("sequoia", 8, 3, 2), ("specexec", 6, 3, 2)]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Toy-language prompts from the tiny model's own language, with branching successors: drafts miss often
    enough that acceptance is a measurement, not a constant."""
    from sglang_spec.models.tiny_deepseek import TINY_DEEPSEEK_CONFIG
    from sglang_spec.models.toy_language import ToyLanguage

    language = ToyLanguage(TINY_DEEPSEEK_CONFIG["vocab_size"], seed=999)
    return language.sample(4, 10).tolist()


@pytest.fixture(scope="module")
def plain(tiny_cpu, server_logs, prompts):
    with running_server(tiny_cpu, server_logs, "tiny-plain", speculative=False) as server:
        greedy = server.generate(prompts, {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS})
    return [answer["output_ids"] for answer in greedy]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda shape: "{}-{}-{}-{}".format(*shape))
def tree_answers(request, tiny_cpu, server_logs, prompts, smollm2_cpu):
    policy, budget, depth, topk = request.param
    # any profile gives sequoia a shape to lay over SGLang's loop; the SmolLM2 head's is at hand
    extra = tree_args(policy, budget, depth, topk, smollm2_cpu.profile)
    with running_server(tiny_cpu, server_logs, "tiny-{}-{}-{}-{}".format(*request.param), extra) as server:
        answers = server.generate(prompts, {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS})
    return request.param, answers


def test_greedy_output_equals_plain_decoding(tree_answers, plain):
    shape, answers = tree_answers
    assert [answer["output_ids"] for answer in answers] == plain, f"{shape}"
    assert max(accept_lengths(answers)) >= 2


def test_accept_length_matches_the_reference_decoder(tree_answers, prompts, tiny):
    """SGLang drafts with the checkpoint's MTP layer exactly as the reference decoder does when the fed-back
    hidden state is the post-norm one (SGLang's NextN feeds back shared_head.norm's output)."""
    shape, answers = tree_answers
    if shape[0] not in ("chain", "eagle"):
        pytest.skip("sequoia / specexec select differently inside SGLang's EAGLE loop until the plugin's own draft "
                    "loop (compared there)")
    from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder
    from sglang_spec.models.registry import load_head_for
    from sglang_spec.tree import TreePolicy

    loaded, _ = tiny
    head = load_head_for(loaded, None, feedback="post_norm")
    policy, budget, depth, topk = shape
    reference = SpeculativeDecoder(loaded.model, head, TreePolicy(policy, budget=budget, depth=depth, topk=topk))
    output = reference.generate(prompts, GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, eos_token_ids=()))
    through_sglang = mean(accept_lengths(answers))
    print(f"\n{shape} mean accept length: SGLang {through_sglang:.3f}, reference {output.accept_length_mean:.3f}")
    assert through_sglang == pytest.approx(output.accept_length_mean, rel=0.10)


def _sampled(tiny_cpu, server_logs, prompts, name: str, seed: int):
    extra = tree_args("eagle", 6, 3, 2) + ["--random-seed", str(seed)]
    with running_server(tiny_cpu, server_logs, name, extra) as server:
        return server.generate(prompts, {"temperature": 0.7, "max_new_tokens": MAX_NEW_TOKENS})


def test_sampled_run_is_reproducible_with_a_seed(tiny_cpu, server_logs, prompts, plain):
    """Temperature 0.7 through SGLang's sampling verify (tree_speculative_sampling_target_only): two servers with
    the same --random-seed give the same tokens, and they are not the greedy ones (sampling really happened)."""
    first = _sampled(tiny_cpu, server_logs, prompts, "tiny-sampled-a", seed=7)
    second = _sampled(tiny_cpu, server_logs, prompts, "tiny-sampled-b", seed=7)
    tokens = [answer["output_ids"] for answer in first]
    assert tokens == [answer["output_ids"] for answer in second]
    assert tokens != plain
    assert all(len(row) == MAX_NEW_TOKENS for row in tokens)
    assert mean(accept_lengths(first)) > 1.0


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
