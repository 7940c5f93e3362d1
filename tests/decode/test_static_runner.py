"""The static-cache runner computes what transformers computes: same logits (to float32 rounding) as
``TransformersRunner`` for prefill, plain steps, tree verifies, commits of accepted paths (chains and branches), batches
of requests with different lengths, finished requests leaving, and a cache that grows past its first capacity."""

import numpy as np
import pytest
import torch

from helpers import random_tree
from sglang_spec.decode.static_runner import StaticTargetRunner, supports, target_runner_for
from sglang_spec.decode.target import TransformersRunner
from sglang_spec.tree.batch import TreeBatch

TOLERANCE = 2e-4  # float32 logits of order 10; sums in another order


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_theta=500.0, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
        parameter.mul_(4.0)  # sharper logits, so a wrong mask or position shows
    return model


def assert_close(ours, theirs):
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() < TOLERANCE, (ours - theirs).abs().max()


def test_runner_choice(tiny_llama, tiny):
    assert supports(tiny_llama) and isinstance(target_runner_for(tiny_llama), StaticTargetRunner)
    loaded, _ = tiny  # tiny DeepSeek-V3 (MLA): transformers' own forward
    assert not supports(loaded.model) and isinstance(target_runner_for(loaded.model), TransformersRunner)
    with pytest.raises(ValueError, match="not a Llama-style model"):
        StaticTargetRunner(loaded.model)


def test_prefill_and_plain_steps(tiny_llama):
    ours, theirs = StaticTargetRunner(tiny_llama), TransformersRunner(tiny_llama)
    prompt = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79])
    a, b = ours.prefill(prompt), theirs.prefill(prompt)
    assert_close(a.last_logits, b.last_logits)
    assert_close(a.hidden, b.hidden)
    # past the first capacity (prompt + 256 slots): the cache grows, the contents stay
    for position in range(len(prompt), len(prompt) + 300):
        token = int(b.last_logits.argmax())
        a, b = ours.decode_one(token, position, a.cache), theirs.decode_one(token, position, b.cache)
        if position % 50 == 0:
            assert_close(a.last_logits, b.last_logits)
    assert a.cache.capacity >= len(prompt) + 300
    assert_close(a.last_logits, b.last_logits)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_verify_commit_and_select_match_transformers(tiny_llama, batch_size):
    rng = np.random.default_rng(batch_size)
    ours, theirs = StaticTargetRunner(tiny_llama), TransformersRunner(tiny_llama)
    prompts = [torch.from_numpy(rng.integers(97, size=int(rng.integers(3, 40)))) for _ in range(batch_size)]
    ours.start_batch([ours.prefill(p) for p in prompts])
    theirs.start_batch([theirs.prefill(p) for p in prompts])
    for step in range(8):
        trees = [random_tree(rng, int(rng.integers(1, 12)), max_fanout=3, max_depth=5, vocab_size=97)
                 for _ in range(len(ours.lengths))]
        batch = TreeBatch.from_trees(trees)
        a, b = ours.verify(batch), theirs.verify(batch)
        for row, tree in enumerate(trees):
            assert_close(a.logits[row, : tree.num_nodes], b.logits[row, : tree.num_nodes])
            assert_close(a.hidden[row, : tree.num_nodes], b.hidden[row, : tree.num_nodes])
        # accept a random root-to-node path (a chain, or a branch whose rows must move)
        kept = [tree.path(int(rng.integers(tree.num_nodes))) for tree in trees]
        ours.commit(kept)
        theirs.commit(kept)
        assert ours.lengths == theirs.lengths
        if step == 4 and batch_size > 1:
            ours.select([0, 2])
            theirs.select([0, 2])
    single = TreeBatch.from_trees([random_tree(rng, 1, 1, 1, 97) for _ in ours.lengths])  # a plain step as a tree
    assert_close(ours.verify(single).logits, theirs.verify(single).logits)


@pytest.mark.model
def test_smollm2_at_a_300_token_context(smollm2):
    loaded, _ = smollm2
    ours, theirs = StaticTargetRunner(loaded.model), TransformersRunner(loaded.model)
    prompt = torch.randint(loaded.model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    ours.start_batch([ours.prefill(prompt)])
    theirs.start_batch([theirs.prefill(prompt)])
    tree = random_tree(np.random.default_rng(0), 16, max_fanout=3, max_depth=8, vocab_size=49152)
    batch = TreeBatch.from_trees([tree])
    a, b = ours.verify(batch), theirs.verify(batch)
    assert (a.logits - b.logits).abs().max() < 1e-3  # logits of order 30
    assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))


def test_fused_weights_are_shared_per_model_and_follow_in_place_changes(tiny_llama):
    first, second = StaticTargetRunner(tiny_llama), StaticTargetRunner(tiny_llama)
    assert first.layers is second.layers  # one fused copy (and one set of GEMM packs) per model
    prompt = torch.arange(1, 9)
    before = first.prefill(prompt).last_logits
    weight = tiny_llama.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        weight.mul_(0.5)
    try:
        third = StaticTargetRunner(tiny_llama)
        assert third.layers is not first.layers
        after = third.prefill(prompt).last_logits
        assert_close(after, TransformersRunner(tiny_llama).prefill(prompt).last_logits)
        assert not torch.allclose(before, after)
    finally:
        with torch.no_grad():
            weight.mul_(2.0)  # the fixture is module-scoped (a power of two: restored exactly)
