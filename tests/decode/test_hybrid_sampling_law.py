"""Sampling with hybrid trees keeps the target's law.

A node the context lookup drafted is a deterministic proposal: given the committed context its "draft
distribution" is a point mass on its token (and the head's top-k children are deterministic too). SpecExec's
sample-and-match draws y ~ p at a node and accepts the child whose token is y, else emits y; it never reads a
draft probability, so it is lossless for any tree that depends only on the past, whoever proposed the nodes.

1. Exact: the law of the token emitted at a node with mixed lookup / head children, enumerated over the coin's
   CDF intervals through the real ``verify_sample_match``, equals p; a ratio rule that takes the lookup's
   calibrated confidence for a draft probability (accept with min(1, p(x) / confidence)) does not.
2. End to end: the joint law of the first three sampled tokens of the tiny model with hybrid trees matches the
   exact law by chi-square, lookup nodes being accepted along the way; the same biased rule fails it.
"""

import numpy as np
import pytest
import torch

from helpers import law_p_value
from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder
from sglang_spec.decode.target import TransformersRunner
from sglang_spec.models.toy_language import ToyLanguage
from sglang_spec.sampling import SamplingParams, sample_from_probs, target_probs_from_logits
from sglang_spec.tree import TokenTree, TreeBatch
from sglang_spec.tree.drafter import TreeDrafter
from sglang_spec.tree.policies import TreePolicy
from sglang_spec.tree.profile import SOURCE_LOOKUP
from sglang_spec.verify import verify_sample_match
from sglang_spec.verify.walk import walk_matching_children

SAMPLING = SamplingParams(temperature=1.0, top_k=3)
TRIALS = 1500


def ratio_rule_token(target, children, confidences, uniform):
    """The biased rule at one node: try each child x in order, accept it with min(1, p(x) / confidence), on
    rejection take confidence * [x] out of p (a SpecInfer-style residual); emit from the residual if none is
    accepted. ``uniform``: callable giving U(0, 1) draws."""
    probs = target.clone()
    for token, confidence in zip(children, confidences):
        if uniform() < min(1.0, float(probs[token]) / confidence):
            return token
        probs[token] = max(float(probs[token]) - confidence, 0.0)
        probs = probs / probs.sum()
    return int(sample_from_probs(probs, torch.tensor(uniform())))


def ratio_rule_law(target, children, confidences):
    """Exact law of the biased rule's emitted token."""
    law, reach, probs = np.zeros(len(target)), 1.0, target.double().clone()
    for token, confidence in zip(children, confidences):
        accept = min(1.0, float(probs[token]) / confidence)
        law[token] += reach * accept
        reach *= 1 - accept
        probs[token] = max(float(probs[token]) - confidence, 0.0)
        probs = probs / probs.sum()
    return law + reach * probs.numpy()


@pytest.mark.parametrize("seed", range(20))
def test_emitted_token_law_at_a_mixed_node_is_exact(seed):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(4, 8))
    target = torch.from_numpy(rng.dirichlet(np.full(vocab, 0.5)))
    # root with 3 children: a lookup copy, a head candidate, a token both proposed (deterministic tokens)
    children = rng.permutation(vocab)[:3].tolist()
    tree = TokenTree.from_parents([-1, 0, 0, 0], tokens=[0, *children])
    batch = TreeBatch.from_trees([tree])
    probs = torch.zeros(1, 4, vocab, dtype=torch.float32)
    probs[0, :] = target.float()
    law = np.zeros(vocab)
    cdf = np.concatenate([[0.0], np.cumsum(target.numpy())])
    for token in range(vocab):  # a coin inside token's CDF interval makes y = token: weight p(token)
        if target[token] == 0:
            continue
        coins = torch.full((1, 4), (cdf[token] + cdf[token + 1]) / 2)
        result = verify_sample_match(batch, probs, coins)
        law[result.tokens(0)[0]] += float(target[token])
    assert np.abs(law - target.numpy()).max() < 1e-6
    confidences = [0.9, 0.6, 0.95]  # calibrated estimates, mistaken for draft probabilities
    biased = ratio_rule_law(target, children, confidences)
    assert abs(biased.sum() - 1) < 1e-9
    assert np.abs(biased - target.numpy()).max() > 1e-3


def toy_prompt(model):
    """Toy-language text, the model's own greedy continuation of it, then the text again: after the prompt the
    context holds what the model tends to say next, so the lookup's copies are likely (and sometimes wrong)."""
    from sglang_spec.decode.decoder import generate_plain

    piece = ToyLanguage(512, seed=123).sample(1, 6)[0].tolist()
    continuation = generate_plain(model, [piece], GenerationConfig(max_new_tokens=8)).requests[0].tokens
    return piece + continuation + piece


def sampling_probs(logits):
    one = torch.ones(1)
    return target_probs_from_logits(logits[None, None], one, torch.tensor([SAMPLING.top_k]), one)[0, 0]


def exact_law(model, prompt):
    """P(x1, x2, x3) over the top-3 supports, from plain target forwards."""
    runner = TransformersRunner(model)
    law = {}
    first = sampling_probs(runner.prefill(torch.tensor(prompt)).last_logits)
    for a in torch.nonzero(first).flatten().tolist():
        second = sampling_probs(runner.prefill(torch.tensor(prompt + [a])).last_logits)
        for b in torch.nonzero(second).flatten().tolist():
            third = sampling_probs(runner.prefill(torch.tensor(prompt + [a, b])).last_logits)
            for c in torch.nonzero(third).flatten().tolist():
                law[(a, b, c)] = float(first[a] * second[b] * third[c])
    return law


class RecordingDrafter(TreeDrafter):
    """Keeps each step's proposed trees so the biased rule can read the nodes' calibrated confidences."""

    def __init__(self, policy):
        super().__init__(policy)
        self.built = []

    def propose(self, root_token, sources):
        built = super().propose(root_token, sources)
        self.built.append(built)
        return built


def biased_verifier(decoder):
    def verify(batch, logits, config, generator):
        built, decoder.tree_drafter.built = decoder.tree_drafter.built, []
        probs = target_probs_from_logits(logits, torch.ones(batch.batch_size), torch.full((batch.batch_size,), 3),
                                         torch.ones(batch.batch_size))
        draws = iter(torch.rand(batch.batch_size * batch.max_nodes * 8, generator=generator).tolist())
        targets = torch.zeros(batch.batch_size, batch.max_nodes, dtype=torch.int64)
        for row, tree in enumerate(built):
            children = tree.tree.children()
            tokens = tree.tree.tokens.tolist()
            for node in range(tree.tree.num_nodes):
                kids = children[node]
                targets[row, node] = ratio_rule_token(probs[row, node].double(), [tokens[k] for k in kids],
                                                      [tree.estimates[k] for k in kids], lambda: next(draws))
        return walk_matching_children(batch, targets)

    return verify


@pytest.mark.slow
@pytest.mark.parametrize("name, lossless", [("lookup", True), ("hybrid", True), ("hybrid", False)])
def test_joint_law_of_the_first_three_tokens_with_hybrid_trees(tiny, name, lossless):
    loaded, head = tiny
    prompt = toy_prompt(loaded.model)
    law = exact_law(loaded.model, prompt)
    policy = TreePolicy(name, budget=6, depth=3, mtp_levels=1, topk=2, lookup_width=2)
    decoder = SpeculativeDecoder(loaded.model, head, policy)
    decoder.tree_drafter = RecordingDrafter(policy)
    if not lossless:
        decoder.verifier = biased_verifier(decoder)
    output = decoder.generate([prompt] * TRIALS, GenerationConfig(max_new_tokens=3, sampling=SAMPLING, seed=11))
    accepted_lookup = sum(1 for request in output.requests for step in request.steps[1:]
                          for source in step.sources[:-1] if source & SOURCE_LOOKUP)
    assert accepted_lookup > TRIALS // 4  # lookup-drafted nodes really are accepted
    p_value = law_p_value(law, [tuple(request.tokens) for request in output.requests])
    if lossless:
        assert p_value > 1e-3, p_value
    else:
        assert p_value < 1e-6, p_value
