"""Sample-and-match that turns only the walked nodes into distributions gives exactly the eager rule's result."""

import numpy as np
import pytest
import torch

from helpers import random_tree
from sglang_spec.sampling import target_probs_from_logits
from sglang_spec.tree import TreeBatch
from sglang_spec.verify import verify_sample_match
from sglang_spec.verify.sample_match import verify_sample_match_on_path

VOCAB = 12  # small, so sampled tokens often match children and walks go deep


@pytest.mark.parametrize("seed", range(6))
def test_equals_the_eager_rule(seed: int) -> None:
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, int(rng.integers(1, 14)), 3, 5, vocab_size=VOCAB) for _ in range(4)]
    batch = TreeBatch.from_trees(trees)
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch.batch_size, batch.max_nodes, VOCAB, generator=generator) * 2
    for row in range(batch.batch_size):  # favour each node's first child, so walks go deep
        for node in range(batch.max_nodes):
            child = int(batch.first_child[row, node])
            if child >= 0:
                logits[row, node, int(batch.tokens[row, child])] += 3.0
    temperature = torch.tensor([0.7, 1.0, 0.0, 1.5])  # a greedy request among sampled ones
    top_k = torch.tensor([0, 4, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.8])
    deepest = 0
    for _ in range(20):
        coins = torch.rand(batch.batch_size, batch.max_nodes, generator=generator)
        eager = verify_sample_match(batch, target_probs_from_logits(logits, temperature, top_k, top_p), coins)
        lazy = verify_sample_match_on_path(batch, logits, temperature, top_k, top_p, coins)
        for field in ("accepted_nodes", "accept_length", "bonus_token", "output_tokens"):
            assert torch.equal(getattr(eager, field), getattr(lazy, field)), field
        deepest = max(deepest, int(eager.accept_length.max()))
    assert deepest >= 3  # the walks went past the root's children
