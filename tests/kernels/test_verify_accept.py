import math

import numpy as np
import pytest
import torch

from helpers import random_candidate_batch, to_device
from sglang_spec.kernels.tree_metadata import build_tree_metadata_reference
from sglang_spec.kernels.verify_accept import (
    AcceptOutputs,
    CandidateSampleMode,
    MatchMode,
    RelaxedMode,
    accept_walk,
    accept_walk_reference,
    node_normalizers,
    node_normalizers_reference,
    node_probabilities,
    search_passes,
    target_tokens,
    target_tokens_reference,
    top_n_probs,
    top_n_probs_reference,
)
from sglang_spec.sampling import target_probs_from_logits
from sglang_spec.verify import RelaxedAcceptance

VOCAB = 40
BLOCK_V = 16  # several vocabulary blocks per row, so the running carries are exercised


def tree_batch(seed, batch=4, nodes=9, topk=3, depth=4, padded_every=3, shapes=("random", "chain", "full")):
    rng = np.random.default_rng(seed)
    data = random_candidate_batch(rng, batch, nodes, topk, depth, VOCAB, shapes, padded_every)
    keys = ("parents", "ranks", "topk_tokens", "topk_probs", "root_tokens", "prefix_lens", "num_nodes")
    meta = build_tree_metadata_reference(**{k: data[k] for k in keys}, max_depth=depth)
    return rng, meta, data["num_nodes"], depth


def logits_favouring_children(rng, meta, accept_rate, sharpness):
    """[B * N, V] logits where, with probability accept_rate, a node's favourite token is one of its children."""
    batch, nodes = meta.tokens.shape
    logits = torch.from_numpy(rng.normal(size=(batch * nodes, VOCAB))).float()
    for b in range(batch):
        for node in range(nodes):
            kids = (meta.parents[b] == node).nonzero().flatten().tolist()
            if kids and rng.random() < accept_rate:
                logits[b * nodes + node, int(meta.tokens[b, int(rng.choice(kids))])] += sharpness
    return logits


def coins_away_from_boundaries(probs, coins, gap=1e-4):
    """Moves coins that fall within ``gap`` of a CDF boundary: there float summation order may legitimately
    differ between the kernel and the reference."""
    cdf = torch.cumsum(probs.double(), -1)
    cdf = cdf / cdf[..., -1:]
    near = ((cdf - coins.double().unsqueeze(-1)).abs() < gap).any(-1)
    return torch.where(near, (coins + 3 * gap) % 1.0, coins)


SAMPLING_MIX = [(1.0, 0, 1.0), (0.6, 3, 0.9), (1.7, 10, 0.5), (0.0, 0, 1.0), (1.3, 0, 0.9), (0.8, 20, 1.0)]


def sampling_params(rng, batch):
    """Per-request (temperature, top_k, top_p), cycling through plain, top-k, top-p, combined and greedy."""
    start = int(rng.integers(len(SAMPLING_MIX)))
    chosen = [SAMPLING_MIX[(start + b) % len(SAMPLING_MIX)] for b in range(batch)]
    temperature, top_k, top_p = zip(*chosen)
    return torch.tensor(temperature).float(), torch.tensor(top_k).long(), torch.tensor(top_p).float()


def test_inverse_cdf_over_a_sweep_of_coins(kernel_device):
    logits = (torch.randn(VOCAB, generator=torch.Generator().manual_seed(4)) * 0.7).expand(64, VOCAB).contiguous()
    probs = target_probs_from_logits(logits[:, None], torch.ones(64), torch.zeros(64).long(), torch.ones(64))
    coins = coins_away_from_boundaries(probs[:, 0], torch.linspace(0.0, 0.999, 64))
    args = (logits, 1, torch.ones(64), torch.zeros(64).long(), torch.ones(64), coins, True)
    tokens = target_tokens(*to_device(args, kernel_device), block_v=BLOCK_V).cpu()
    assert torch.equal(tokens, target_tokens_reference(*args))
    assert len(set(tokens.tolist())) > 20  # the sweep really walks across the distribution


@pytest.mark.parametrize("seed", range(3))
def test_target_tokens_greedy_equals_reference(kernel_device, seed):
    rng, meta, _, _ = tree_batch(seed)
    logits = logits_favouring_children(rng, meta, 0.8, 4.0)
    batch, nodes = meta.tokens.shape
    zeros = torch.zeros(batch)
    args = (logits, nodes, zeros, zeros.long(), torch.ones(batch), torch.zeros(batch * nodes), False)
    kernel = target_tokens(*to_device(args, kernel_device), block_v=BLOCK_V).cpu()
    assert torch.equal(kernel, target_tokens_reference(*args))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_target_tokens_sampling_equals_reference(kernel_device, seed):
    rng, meta, _, _ = tree_batch(seed, batch=6, nodes=5, padded_every=0)
    logits = logits_favouring_children(rng, meta, 0.6, 2.0)
    batch, nodes = meta.tokens.shape
    temperature, top_k, top_p = sampling_params(rng, batch)
    probs = target_probs_from_logits(logits.reshape(batch, nodes, -1), temperature, top_k, top_p)
    coins = coins_away_from_boundaries(probs, torch.from_numpy(rng.random((batch, nodes))).float()).reshape(-1)
    args = (logits, nodes, temperature, top_k, top_p, coins, True)
    kernel = target_tokens(*to_device(args, kernel_device), block_v=BLOCK_V).cpu()
    reference = target_tokens_reference(*args)
    assert torch.equal(kernel, reference), (kernel, reference, temperature, top_k, top_p)


def test_top_k_and_top_p_thresholds_keep_ties(kernel_device):
    # weights 1, 1, 0.5, 0.5, 0.25: top-k 3 keeps the two tied 0.5s; top-p 0.5 keeps both tied 1s
    coins = torch.linspace(0.001, 0.999, 16)
    logits = torch.log(torch.tensor([0.25, 1.0, 0.5, 1.0, 0.5])).expand(len(coins), 5).contiguous()
    for top_k, top_p, allowed in [(3, 1.0, {1, 2, 3, 4}), (0, 0.5, {1, 3}), (1, 1.0, {1, 3})]:
        rows = len(coins)
        args = (logits, 1, torch.ones(rows), torch.full((rows,), top_k), torch.full((rows,), top_p), coins, True)
        tokens = target_tokens(*to_device(args, kernel_device), block_v=2).cpu()
        assert torch.equal(tokens, target_tokens_reference(*args))
        assert set(tokens.tolist()) == allowed, (top_k, top_p, tokens)


def test_top_n_probs_equals_reference(kernel_device):
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    tokens, probs = to_device(top_n_probs(logits.to(kernel_device), 4, block_v=BLOCK_V), "cpu")
    reference_tokens, reference_probs = top_n_probs_reference(logits, 4)
    assert torch.equal(tokens, reference_tokens)
    assert torch.allclose(probs, reference_probs, atol=1e-6)


def run_walk(function, meta, num_nodes, depth, mode, device="cpu"):
    """(AcceptOutputs, output_ids, output_lens) on the CPU, from ``function`` run on ``device``."""
    batch = meta.tokens.shape[0]
    output_ids = torch.full((batch, 6), -7, dtype=torch.int64)
    output_lens = torch.tensor([0, 2, 4, 5][:batch] + [1] * max(0, batch - 4), dtype=torch.int64)
    args = to_device((meta.tokens, meta.parents, num_nodes, depth, output_ids, output_lens, mode), device)
    out = function(*args)
    return to_device((out, args[4], args[5]), "cpu")


def assert_same(kernel, reference):
    for name in AcceptOutputs.__dataclass_fields__:
        assert torch.equal(getattr(kernel[0], name), getattr(reference[0], name)), name
    assert torch.equal(kernel[1], reference[1]) and torch.equal(kernel[2], reference[2])


@pytest.mark.parametrize("seed", range(4))
def test_accept_walk_match_mode_equals_reference(kernel_device, seed):
    rng, meta, num_nodes, depth = tree_batch(seed, batch=5, nodes=13, topk=3, depth=5)
    logits = logits_favouring_children(rng, meta, 0.9, 6.0)
    target = logits.argmax(-1)
    kernel = run_walk(accept_walk, meta, num_nodes, depth, MatchMode(target), kernel_device)
    reference = run_walk(accept_walk_reference, meta, num_nodes, depth, MatchMode(target))
    assert_same(kernel, reference)
    assert int(kernel[0].accept_length.max()) >= 3  # deep paths really occur
    assert kernel[0].accept_length[num_nodes == 0].tolist() == [0] * int((num_nodes == 0).sum())


@pytest.mark.parametrize("seed", range(3))
def test_accept_walk_relaxed_mode_equals_reference(kernel_device, seed):
    rng, meta, num_nodes, depth = tree_batch(seed, batch=4, nodes=9, topk=3, depth=4)
    logits = logits_favouring_children(rng, meta, 0.9, 1.0)  # soft: non-argmax children are often within delta
    batch, nodes = meta.tokens.shape
    think_begin, think_end = int(meta.tokens[0, 1]) if nodes > 1 else 1, 39
    relaxed = RelaxedAcceptance(top_n=3, delta=0.3, think_begin_token=think_begin, think_end_token=think_end)
    thinking = torch.tensor(rng.integers(0, 2, size=batch), dtype=torch.int8)
    mode = RelaxedMode(*top_n_probs_reference(logits, relaxed.top_n), thinking, relaxed)
    kernel = run_walk(accept_walk, meta, num_nodes, depth, mode, kernel_device)
    reference = run_walk(accept_walk_reference, meta, num_nodes, depth, mode)
    assert_same(kernel, reference)


@pytest.mark.sglang
@pytest.mark.parametrize("seed", range(3))
def test_greedy_accept_agrees_with_sglangs_verify_tree_greedy(sglang_kernels, kernel_device, seed):
    rng, meta, num_nodes, depth = tree_batch(seed, batch=3, nodes=11, topk=3, depth=5, padded_every=0,
                                             shapes=("full",))
    logits = logits_favouring_children(rng, meta, 0.9, 6.0)
    args = (logits, 11, torch.zeros(3), torch.zeros(3).long(), torch.ones(3), torch.zeros(33), False)
    target = target_tokens(*to_device(args, kernel_device), block_v=BLOCK_V).cpu()
    ours, output_ids, _ = run_walk(accept_walk, meta, num_nodes, depth, MatchMode(target), kernel_device)
    predicts, accept_index, accept_num = sglang_kernels.verify_greedy(
        meta.tokens, meta.retrieve_index, meta.first_child, meta.next_sibling, target.reshape(3, 11), depth + 1
    )
    assert accept_num.tolist() == (ours.accept_length - 1).tolist()
    global_ids = torch.where(ours.accepted_nodes >= 0, ours.accepted_nodes + 11 * torch.arange(3)[:, None], -1)
    assert accept_index.long().tolist() == global_ids.tolist()
    for b in range(3):
        emitted = [int(predicts[global_ids[b, j]]) for j in range(int(ours.accept_length[b]))]
        start = [0, 2, 4][b]
        assert output_ids[b, start : start + len(emitted)].tolist() == emitted[: 6 - start]


def candidate_sample_mode(rng, meta, logits, batch, nodes):
    inverse_temperature = torch.tensor(rng.uniform(0.6, 2.0, size=batch)).float()
    normalizers = node_normalizers_reference(logits, nodes, inverse_temperature)
    probs = node_probabilities(logits, nodes, inverse_temperature, normalizers)
    # the running sums of children probabilities are what the coins are compared with: keep coins off them
    coins = torch.from_numpy(rng.random((batch, nodes))).float()
    final = torch.from_numpy(rng.random(batch)).float()
    coins = coins_away_from_boundaries(probs, coins)
    final = coins_away_from_boundaries(probs[:, 0], final)
    return CandidateSampleMode(logits, inverse_temperature, normalizers, coins.reshape(-1), final)


def test_node_normalizers_equal_reference(kernel_device):
    rng, meta, _, _ = tree_batch(5)
    logits = logits_favouring_children(rng, meta, 0.7, 3.0)
    batch, nodes = meta.tokens.shape
    inverse_temperature = torch.tensor(rng.uniform(0.5, 2.0, size=batch)).float()
    kernel = node_normalizers(*to_device((logits, nodes, inverse_temperature), kernel_device), block_v=BLOCK_V).cpu()
    reference = node_normalizers_reference(logits, nodes, inverse_temperature)
    assert torch.equal(kernel[:, 0], reference[:, 0])
    assert torch.allclose(kernel[:, 1], reference[:, 1], rtol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_accept_walk_candidate_sample_mode_equals_reference(kernel_device, seed):
    """SGLang's sampling rule (candidate buckets first, residual without the last node's children by the final
    coin): kernel and reference read the same logits, normalizers and coins and make the same choices."""
    rng, meta, num_nodes, depth = tree_batch(seed, batch=5, nodes=13, topk=3, depth=5)
    logits = logits_favouring_children(rng, meta, 0.9, 3.0)
    batch, nodes = meta.tokens.shape
    mode = candidate_sample_mode(rng, meta, logits, batch, nodes)
    kernel = run_walk(accept_walk, meta, num_nodes, depth, mode, kernel_device)
    reference = run_walk(accept_walk_reference, meta, num_nodes, depth, mode)
    assert_same(kernel, reference)
    assert int(kernel[0].accept_length.max()) >= 2


@pytest.mark.parametrize("ways", [1, 3, 16])
def test_the_k_ary_search_pins_every_answer_in_its_passes(ways):
    """The kernel's search step on the host: candidates low + j * width // (ways + 1), j = 1..ways, then the largest
    that holds and the first that fails; every answer of a span is found in ``search_passes`` passes."""
    span = 700
    passes = search_passes(ways, span)
    assert passes == math.ceil(math.log(span, ways + 1) - 1e-9)
    for answer in range(span):
        low, high = 0, span - 1
        for _ in range(passes):
            candidates = [low + j * (high - low + 1) // (ways + 1) for j in range(1, ways + 1)]
            holds = [candidate <= answer for candidate in candidates]
            low = max([c for c, h in zip(candidates, holds) if h], default=low)
            high = min([c - 1 for c, h in zip(candidates, holds) if not h], default=high)
        assert low == high == answer, (ways, answer)
    assert search_passes(16) == 8 and search_passes(1) == 30  # the kernel's: 8 passes where a bisection took 30
