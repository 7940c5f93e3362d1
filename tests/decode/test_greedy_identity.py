"""Greedy tree speculation reproduces plain greedy decoding token for token (float32), for every policy, batch 1
and batches of prompts with different lengths. A divergence is excused only where the plain run's top-2 logit
gap at that step is below 1e-4; such cases are counted and reported, never silently passed."""

import numpy as np
import pytest

from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder, compare_with_plain, generate_plain
from sglang_spec.tree import AcceptanceProfile, TreePolicy
from sglang_spec.verify import RelaxedAcceptance

PROFILE = AcceptanceProfile.from_obj({"rank_acceptance": [[0.7, 0.15, 0.05], [0.6, 0.15, 0.05]]})
POLICIES = ["chain", "eagle", "sequoia", "specexec"]


def tiny_prompts(count=20, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 512, size=int(rng.integers(2, 14))).tolist() for _ in range(count)]


def check_identity(model, head, prompts, policy, config, batch_size, report, plain=None):
    """``plain``: plain decoding's output for ``prompts`` and ``config`` when the caller has it (else decoded here)."""
    plain = plain if plain is not None else generate_plain(model, prompts, config)
    decoder = SpeculativeDecoder(model, head, policy)
    outputs = []
    for start in range(0, len(prompts), batch_size):
        outputs += decoder.generate(prompts[start : start + batch_size], config).requests
    comparisons = [compare_with_plain(ours, theirs) for ours, theirs in zip(outputs, plain.requests)]
    excused = [c for c in comparisons if not c.identical and c.excused]
    report.append((f"{type(model).__name__} {policy.name} batch {batch_size}", len(excused)))
    failures = [(i, c) for i, c in enumerate(comparisons) if not c.identical and not c.excused]
    assert not failures, failures
    return outputs


@pytest.mark.parametrize("policy_name", POLICIES)
@pytest.mark.parametrize("batch_size", [1, 5])
def test_tiny_deepseek_greedy_identity(tiny, policy_name, batch_size, near_tie_report):
    loaded, head = tiny
    policy = TreePolicy(policy_name, budget=10, depth=4, topk=3, profile=PROFILE)
    outputs = check_identity(loaded.model, head, tiny_prompts(), policy, GenerationConfig(max_new_tokens=24),
                             batch_size, near_tie_report)
    accept = [length for request in outputs for length in request.accept_lengths]
    assert np.mean(accept) > 2.5 and max(accept) == 5  # deep accepted runs really happen


def test_eos_and_max_new_tokens_are_honoured_inside_an_accepted_run(tiny):
    loaded, head = tiny
    prompts = tiny_prompts(6, seed=1)
    policy = TreePolicy("sequoia", budget=10, depth=4, topk=3, profile=PROFILE)
    decoder = SpeculativeDecoder(loaded.model, head, policy)
    reference = generate_plain(loaded.model, prompts, GenerationConfig(max_new_tokens=30))
    # an "EOS" that plain decoding emits mid-sequence, where speculation accepts runs of several tokens
    eos = reference.requests[0].tokens[7]
    for config in [GenerationConfig(max_new_tokens=30, eos_token_ids=(eos,)), GenerationConfig(max_new_tokens=7)]:
        plain = generate_plain(loaded.model, prompts, config)
        ours = decoder.generate(prompts, config)
        for a, b in zip(ours.requests, plain.requests):
            assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
    assert plain.requests[0].finish_reason == "length"
    eos_run = decoder.generate(prompts, GenerationConfig(max_new_tokens=30, eos_token_ids=(eos,)))
    assert eos_run.requests[0].finish_reason == "eos" and eos_run.requests[0].tokens[-1] == eos
    assert max(eos_run.requests[0].accept_lengths) > 1


def test_random_model_with_random_head_is_also_identical(random_tiny, near_tie_report):
    """Near-zero acceptance: every step is a bonus-only step, which must still be exact."""
    model, head = random_tiny
    check_identity(model, head, tiny_prompts(8, seed=2), TreePolicy("specexec", 12, 4, topk=4),
                   GenerationConfig(max_new_tokens=12), 4, near_tie_report)


def test_relaxed_rule_with_zero_delta_is_greedy_decoding(tiny, near_tie_report):
    """The LOSSY relaxed rule runs through the decoder with the one RelaxedAcceptance type; with delta 0 it only
    accepts the argmax, so the output is plain greedy decoding's."""
    loaded, head = tiny
    relaxed = RelaxedAcceptance(top_n=4, delta=0.0, think_begin_token=5, think_end_token=6)
    policy = TreePolicy("sequoia", budget=10, depth=4, topk=3, profile=PROFILE)
    check_identity(loaded.model, head, tiny_prompts(6, seed=3), policy,
                   GenerationConfig(max_new_tokens=16, relaxed=relaxed), 3, near_tie_report)
