"""SmolLM2-135M-Instruct (float32) with the shipped head: greedy tree speculation is token-identical to plain
greedy decoding on 20 prompts (10 held-out HumanEval tasks, 10 chat prompts), every policy, batch 1 and 4."""

import pytest

from sglang_spec.decode.decoder import GenerationConfig, generate_plain
from sglang_spec.train.generate_traffic import prompt_tokens
from sglang_spec.train.prompts import humaneval_prompts
from sglang_spec.tree import TreePolicy
from sglang_spec.tree.profile import AcceptanceProfile
from test_greedy_identity import check_identity

CHAT = [
    "What is the capital of France?", "Tell me a joke about computers.", "How do I boil an egg?",
    "Explain recursion in one sentence.", "What is 12 times 7?", "Name three primary colors.",
    "Write a haiku about rain.", "Why is the sky blue?", "Give me a tip for learning Python.", "What is a CPU?",
]
PROFILE = AcceptanceProfile.from_obj({"rank_acceptance": [[0.6, 0.1, 0.05, 0.03], [0.5, 0.1, 0.05]]})


@pytest.fixture(scope="module")
def prompts(smollm2):
    loaded, _ = smollm2
    code = [prompt_tokens(loaded, spec) for spec in humaneval_prompts(120, 129)]
    chat = [loaded.encode_prompt(text) for text in CHAT]
    return code + chat


@pytest.fixture(scope="module")
def config(smollm2) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=16, eos_token_ids=smollm2[0].eos_token_ids)


@pytest.fixture(scope="module")
def plain(smollm2, prompts, config):
    """Plain greedy decoding of the prompts, once for every policy."""
    return generate_plain(smollm2[0].model, prompts, config)


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("policy_name", ["chain", "eagle", "sequoia", "specexec"])
def test_smollm2_greedy_identity(smollm2, prompts, config, plain, policy_name, near_tie_report):
    loaded, head = smollm2
    policy = TreePolicy(policy_name, budget=8, depth=4, topk=4, profile=PROFILE)
    outputs = check_identity(loaded.model, head, prompts, policy, config, 1, near_tie_report, plain)
    check_identity(loaded.model, head, prompts, policy, config, 4, near_tie_report, plain)
    lengths = [length for request in outputs for length in request.accept_lengths]
    assert sum(lengths) / len(lengths) > 1.5  # the shipped head really gets drafts accepted
