"""Sampling with tree speculation keeps the target's distribution: the joint law of the first three generated
tokens matches the exact law by chi-square; a deliberately biased acceptance rule fails the same test."""


import pytest
import torch

from helpers import law_p_value
from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder, lossless_verify
from sglang_spec.decode.target import TransformersRunner
from sglang_spec.sampling import SamplingParams, sample_from_probs, target_probs_from_logits
from sglang_spec.tree import AcceptanceProfile, TreePolicy
from sglang_spec.verify.walk import walk_matching_children

SAMPLING = SamplingParams(temperature=1.0, top_k=3)
PROMPT = [5, 77, 300, 41]
TRIALS = 1200


def sampling_probs(logits):
    one = torch.ones(1)
    return target_probs_from_logits(logits[None, None], one, torch.tensor([SAMPLING.top_k]), one)[0, 0]


def exact_law(model):
    """P(x1, x2, x3) for every triple in the top-3 supports, from plain target forwards."""
    runner = TransformersRunner(model)
    law = {}
    first = sampling_probs(runner.prefill(torch.tensor(PROMPT)).last_logits)
    for a in torch.nonzero(first).flatten().tolist():
        second = sampling_probs(runner.prefill(torch.tensor(PROMPT + [a])).last_logits)
        for b in torch.nonzero(second).flatten().tolist():
            third = sampling_probs(runner.prefill(torch.tensor(PROMPT + [a, b])).last_logits)
            for c in torch.nonzero(third).flatten().tolist():
                law[(a, b, c)] = float(first[a] * second[b] * third[c])
    return law


def biased_verify(batch, logits, config, generator):
    """Negative control: accepts the most likely child whenever its target probability is >= 0.25 (a relaxed
    threshold, like a single-token threshold below 1), else SpecExec's rule."""
    probs = target_probs_from_logits(
        logits, torch.ones(batch.batch_size), torch.full((batch.batch_size,), SAMPLING.top_k),
        torch.ones(batch.batch_size)
    )
    targets = sample_from_probs(probs, torch.rand(batch.batch_size, batch.max_nodes, generator=generator))
    for row in range(batch.batch_size):
        for node in range(int(batch.num_nodes[row])):
            children = (batch.parents[row] == node).nonzero().flatten()
            if len(children):
                child_probs = probs[row, node, batch.tokens[row, children]]
                best = int(child_probs.argmax())
                if child_probs[best] >= 0.25:
                    targets[row, node] = batch.tokens[row, children[best]]
    return walk_matching_children(batch, targets)


@pytest.mark.slow
@pytest.mark.parametrize("verifier, lossless", [(lossless_verify, True), (biased_verify, False)])
def test_joint_law_of_the_first_three_tokens(tiny, verifier, lossless):
    loaded, head = tiny
    law = exact_law(loaded.model)
    policy = TreePolicy("sequoia", budget=6, depth=2, topk=3,
                        profile=AcceptanceProfile.uniform([0.6, 0.25, 0.1]))
    decoder = SpeculativeDecoder(loaded.model, head, policy, verifier=verifier)
    output = decoder.generate([PROMPT] * TRIALS, GenerationConfig(max_new_tokens=3, sampling=SAMPLING, seed=7))
    assert output.accept_length_mean > 1.3  # drafts are really accepted, not only bonus tokens
    p_value = law_p_value(law, [tuple(request.tokens) for request in output.requests])
    if lossless:
        assert p_value > 1e-3, p_value
    else:
        assert p_value < 1e-6, p_value
