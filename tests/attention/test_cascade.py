import numpy as np
import torch

from helpers import random_tree
from sglang_spec.attention.cascade import (
    AttentionState,
    merge_states,
    mla_tree_attention_cascade,
    mla_tree_attention_reference,
)


def test_cascade_equals_one_masked_attention_over_prefix_and_tree():
    rng = np.random.default_rng(0)
    generator = torch.Generator().manual_seed(0)
    heads, latent, rope = 4, 32, 8
    for prefix_len, nodes in [(0, 5), (1, 1), (17, 9), (64, 16)]:
        tree = random_tree(rng, nodes, 3, 5)
        mask = tree.ancestor_mask()
        q_latent = torch.randn(nodes, heads, latent, generator=generator, dtype=torch.float64)
        q_rope = torch.randn(nodes, heads, rope, generator=generator, dtype=torch.float64)
        prefix = (torch.randn(prefix_len, latent, generator=generator, dtype=torch.float64),
                  torch.randn(prefix_len, rope, generator=generator, dtype=torch.float64))
        tree_kv = (torch.randn(nodes, latent, generator=generator, dtype=torch.float64),
                   torch.randn(nodes, rope, generator=generator, dtype=torch.float64))
        scale = (latent + rope) ** -0.5
        cascade = mla_tree_attention_cascade(q_latent, q_rope, *prefix, *tree_kv, mask, scale)
        reference = mla_tree_attention_reference(q_latent, q_rope, *prefix, *tree_kv, mask, scale)
        assert torch.allclose(cascade.out, reference.out, atol=1e-12)
        assert torch.allclose(cascade.lse, reference.lse, atol=1e-12)


def test_merge_needs_the_lse_weights():
    """Negative control: averaging the two partial outputs (ignoring lse) is not attention."""
    first = AttentionState(torch.tensor([[[1.0, 0.0]]]), torch.tensor([[2.0]]))
    second = AttentionState(torch.tensor([[[0.0, 1.0]]]), torch.tensor([[0.0]]))
    merged = merge_states(first, second)
    weight = np.exp(2) / (np.exp(2) + 1)
    assert torch.allclose(merged.out, torch.tensor([[[weight, 1 - weight]]], dtype=torch.float32))
    assert not torch.allclose(merged.out, (first.out + second.out) / 2)
    empty = AttentionState(torch.zeros(1, 1, 2), torch.tensor([[-float("inf")]]))
    assert torch.equal(merge_states(empty, second).out, second.out)  # an empty prefix contributes nothing
