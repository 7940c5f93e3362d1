"""The CPU harness's stand-ins for sgl-kernel ops, each against an independent reference (SGLang's own Triton twin
where one exists, plain torch otherwise), so the end-to-end tests through SGLang's server rest on checked ops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from doubles import SyntheticCandidates
from helpers import random_tree, targets_following_drafts
from sglang_spec_testbed import attention, ops, sampling
from sglang_spec.sglang_plugin.drafters.beam_selection import DraftLoop
from sglang_spec.tree import TokenTree
from sglang_spec.tree.encode_sglang import TreeMaskMode, encode_sglang_verify

pytestmark = pytest.mark.sglang


def eagle_draft(width: int, children: int, steps: int, budget: int, roots: list[int], seed: int):
    """Draft outputs in SGLang's EAGLE-2 encoding from the plugin's loop with a synthetic drafter."""
    source = SyntheticCandidates(vocab_size=50, seed=seed, sharpness=1.3)
    loop = DraftLoop.build(width, children, steps, None, "cpu")

    def top(paths):
        return torch.topk(torch.stack([source.distribution(path) for path in paths]), width, dim=-1)

    level = loop.root_level(*top([[root] for root in roots]))
    levels, paths = [level], [[[root, int(t)] for t in level.tokens[row]] for row, root in enumerate(roots)]
    for step in range(1, steps):
        level = loop.next_level(step, level.beam_scores, *top([p for row in paths for p in row]))
        levels.append(level)
        tokens = level.beam_tokens.view(len(roots), width)
        paths = [[paths[r][int(level.parent_beam[r, j])] + [int(tokens[r, j])] for j in range(width)]
                 for r in range(len(roots))]
    return loop.organize(levels, budget)


@pytest.mark.parametrize("width, children, steps, budget", [(4, 4, 4, 15), (12, 3, 5, 20), (6, 2, 3, 8)])
@pytest.mark.parametrize("mode", [TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY])
def test_build_tree_stand_in_equals_sglangs_triton_twin(sglang_with_plugin, width, children, steps, budget, mode):
    from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton

    roots = [3, 4, 5]
    parent_list, top_scores_index, _ = eagle_draft(width, children, steps, budget, roots, seed=width + budget)
    seq_lens = torch.tensor([7, 3, 11])
    n = budget + 1
    outputs = []
    for build in (ops.build_tree_kernel_efficient_cpu, sgl_build_tree_kernel_triton):
        size = n * n * 3 if mode == TreeMaskMode.QLEN_ONLY else int(seq_lens.sum()) * n + n * n * 3
        tree_mask = torch.full((size,), True)
        positions = torch.empty(3 * n, dtype=torch.long)
        retrieve = torch.full((3, 3, n), -1, dtype=torch.long)
        build(parent_list, top_scores_index, seq_lens, tree_mask, positions, retrieve[0], retrieve[1], retrieve[2],
              width, steps, n, mode)
        outputs.append((tree_mask, positions, retrieve))
    for ours, theirs in zip(*outputs):
        assert torch.equal(ours, theirs)


def verify_greedy_outputs(verify, candidates, links, target, levels: int):
    """Runs ``verify`` (the stand-in or SGLang's Triton twin) on buffers as ``eagle_sample`` allocates them, with
    ``predicts`` pre-filled so that untouched entries are compared too."""
    batch, n = candidates.shape
    predicts = torch.full((batch * n,), -7, dtype=torch.int32)
    accept_index = torch.full((batch, levels), -1, dtype=torch.int32)
    accept_token_num = torch.full((batch,), -5, dtype=torch.int32)
    retrieve_index = torch.arange(batch * n).view(batch, n)
    verify(predicts, accept_index, accept_token_num, candidates, retrieve_index, *links, target)
    return predicts, accept_index, accept_token_num


@pytest.mark.parametrize("seed, batch, nodes, depth, fanout", [(0, 3, 16, 4, 4), (1, 5, 9, 6, 2), (2, 1, 1, 3, 1),
                                                                (3, 4, 33, 5, 8), (4, 2, 12, 11, 1)])
def test_verify_tree_greedy_stand_in_equals_sglangs_triton_twin(sglang_kernels, seed, batch, nodes, depth, fanout):
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, nodes, fanout, depth, vocab_size=20) for _ in range(batch)]
    meta = encode_sglang_verify(trees, [depth + 1] * batch)
    target = targets_following_drafts(rng, trees, nodes, accept_rate=0.8, vocab_size=20)
    candidates = meta.draft_tokens.view(batch, nodes).long()
    links = (meta.retrieve_next_token, meta.retrieve_next_sibling)
    for levels in (depth + 1, max(depth - 1, 1)):  # the walk bounded by the tree, or cut short by S
        ours = verify_greedy_outputs(ops.verify_tree_greedy_cpu, candidates, links, target, levels)
        theirs = verify_greedy_outputs(sglang_kernels.spec_tree.verify_tree_greedy_triton, candidates, links, target,
                                       levels)
        for mine, want in zip(ours, theirs):
            assert torch.equal(mine, want)
    if nodes > 1:
        assert int(ours[2].sum()) > 0  # the targets follow the drafts often enough to walk


@pytest.mark.parametrize("seed", range(4))
def test_verify_tree_greedy_stand_in_follows_arbitrary_links_like_sglangs_triton_twin(sglang_kernels, seed):
    """Links that are no tree (cycles, a node its own sibling, a child chain revisiting nodes): the Triton twin's
    bounded loops decide, and the stand-in must decide the same."""
    generator = torch.Generator().manual_seed(seed)
    batch, n, levels = 4, 7, 6
    candidates = torch.randint(0, 3, (batch, n), generator=generator)
    links = tuple(torch.randint(-1, n, (batch, n), generator=generator) for _ in range(2))
    target = torch.randint(0, 3, (batch, n), generator=generator)
    ours = verify_greedy_outputs(ops.verify_tree_greedy_cpu, candidates, links, target, levels)
    theirs = verify_greedy_outputs(sglang_kernels.spec_tree.verify_tree_greedy_triton, candidates, links, target,
                                   levels)
    for mine, want in zip(ours, theirs):
        assert torch.equal(mine, want)


def test_copy_all_layer_kv_cache_moves_rows_in_place_like_a_gather_then_scatter():
    layers = [torch.randn(20, 2, 3), torch.randn(20, 5)]
    expected = [layer.clone() for layer in layers]
    pointers = torch.tensor([layer.data_ptr() for layer in layers])
    strides = torch.tensor([layer[0].numel() * layer.element_size() for layer in layers])
    # overlapping (a permutation of 4, 5, 6) with a row in place (7); then rows further down the same buffers
    for target, source in ((torch.tensor([4, 5, 6, 1, 7]), torch.tensor([5, 6, 4, 9, 7])),
                           (torch.tensor([18, 2]), torch.tensor([3, 19])), (torch.tensor([8]), torch.tensor([8]))):
        for layer in expected:
            layer[target] = layer[source].clone()
        ops.copy_all_layer_kv_cache_cpu(pointers, strides, target, source)
        for layer, want in zip(layers, expected):
            assert torch.equal(layer, want)


def sdpa(q, k, v, allowed, scaling, logit_cap=0.0):
    """Reference attention, an explicit softmax (the stand-in runs torch's fused kernel): q [Q, H, D], k / v
    [T, Hkv, D], allowed [Q, T] -> [Q, H, Dv]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,thd->hqt", q, k) * scaling
    if logit_cap:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    weights = torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), dim=-1)
    return torch.einsum("hqt,thd->qhd", weights, v)


def test_extend_attention_with_a_tree_mask_and_decode_attention_match_sdpa():
    torch.manual_seed(0)
    slots, heads, kv_heads, dim = 64, 4, 2, 8
    k_buffer, v_buffer = torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim)
    req_to_token = torch.randperm(slots).view(2, 32).to(torch.int32)
    tree = TokenTree.from_parents([-1, 0, 0, 1, 1, 2])
    n, prefixes = tree.num_nodes, [5, 9]
    seq_lens = torch.tensor([prefix + n for prefix in prefixes])
    q = torch.randn(2 * n, heads, dim)
    out = torch.empty(2 * n, heads, dim)
    mask = encode_sglang_verify([tree, tree], torch.tensor(prefixes), TreeMaskMode.QLEN_ONLY).tree_mask
    attention.extend_attention_cpu(q, None, None, out, k_buffer, v_buffer, 1.0, 1.0, req_to_token, torch.tensor([0, 1]),
                                   seq_lens, torch.tensor([n, n]), torch.tensor([0, n]), n, 0.3, 0.0, False, 0, None,
                                   None, mask, True)
    for row, prefix in enumerate(prefixes):
        keys = req_to_token[row, : prefix + n].long()
        allowed = torch.ones(n, prefix + n, dtype=torch.bool)
        allowed[:, prefix:] = tree.ancestor_mask()
        want = sdpa(q[row * n:(row + 1) * n], k_buffer[keys], v_buffer[keys], allowed, 0.3)
        assert torch.allclose(out[row * n:(row + 1) * n], want, atol=1e-5)
    decoded = torch.empty(2, heads, dim)
    attention.decode_attention_cpu(q[:2], k_buffer, v_buffer, 1.0, 1.0, decoded, None, None, None, None, req_to_token,
                                   torch.tensor([0, 1]), torch.tensor([7, 12]), 0.3, 0.0, False, 0, None, None)
    for row, length in enumerate([7, 12]):
        keys = req_to_token[row, :length].long()
        want = sdpa(q[row:row + 1], k_buffer[keys], v_buffer[keys], torch.ones(1, length, dtype=torch.bool), 0.3)
        assert torch.allclose(decoded[row], want[0], atol=1e-5)


@pytest.mark.parametrize("tagged, passes", [(True, 2), (False, 6)])
def test_a_draft_steps_beams_attend_once_per_request_and_match_the_explicit_softmax(monkeypatch, tagged, passes):
    """A draft step's per-beam table (``build_draft_decode_metadata_cpu``: a request's prefix, then each beam's own
    draft slots) carries its requests' prefix lengths, and the decode stand-in attends each request's beams in one
    pass; the same table untagged goes row by row. Every row against the explicit softmax over its own slots."""
    torch.manual_seed(3)
    slots, heads, kv_heads, dim, topk, steps = 256, 4, 2, 8, 3, 3
    k_buffer, v_buffer = torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim)
    req_to_token = torch.randperm(slots)[:128].view(2, 64).to(torch.int32)
    prefixes = torch.tensor([20, 25])
    table = ops.build_draft_decode_metadata_cpu(req_to_token, torch.tensor([0, 1]), prefixes, topk, steps, 64)
    if not tagged:
        table = table.clone()  # a tensor without the attribute: what every other decode table is
    lengths = prefixes.repeat_interleave(topk) + 2  # the second draft step: prefix + two draft slots a beam
    calls = []
    attend = attention._attend
    monkeypatch.setattr(attention, "_attend", lambda *args, **kwargs: calls.append(1) or attend(*args, **kwargs))
    q = torch.randn(2 * topk, heads, dim)
    decoded = torch.empty(2 * topk, heads, dim)
    attention.decode_attention_cpu(q, k_buffer, v_buffer, 1.0, 1.0, decoded, None, None, None, None, table,
                                   torch.arange(2 * topk), lengths, 0.3, 0.0, False, 0, None, None)
    assert len(calls) == passes
    for row, length in enumerate(lengths.tolist()):
        keys = table[row, :length].long()
        assert len(set(keys.tolist())) == length  # a beam's own slots are not its prefix's or another beam's
        want = sdpa(q[row:row + 1], k_buffer[keys], v_buffer[keys], torch.ones(1, length, dtype=torch.bool), 0.3)
        assert torch.allclose(decoded[row], want[0], atol=1e-5)


def extend_row_one_causally(q, out, k_buffer, v_buffer, req_to_token, prefix: int, new: int, sliding_window: int,
                            logit_cap: float):
    """The extend stand-in over request row 1 (``new`` causal queries after ``prefix`` cached tokens, scaling 0.3)
    into ``out``; returns the keys' cache slots and the mask [new, prefix + new] the explicit softmax applies."""
    attention.extend_attention_cpu(q, None, None, out, k_buffer, v_buffer, 1.0, 1.0, req_to_token, torch.tensor([1]),
                                   torch.tensor([prefix + new]), torch.tensor([new]), torch.tensor([0]), new, 0.3,
                                   logit_cap, False, sliding_window, None, None, None, True)
    positions = torch.arange(prefix + new)
    allowed = positions[None, :] <= (prefix + torch.arange(new))[:, None]
    if sliding_window:
        allowed &= positions[None, :] > (prefix + torch.arange(new))[:, None] - sliding_window
    keys = req_to_token[1, : prefix + new].long()
    return keys, allowed


@pytest.mark.parametrize("sliding_window, logit_cap", [(0, 0.0), (6, 0.0), (0, 5.0), (6, 5.0)])
def test_causal_extend_and_decode_attention_with_window_and_cap_match_the_explicit_softmax(sliding_window, logit_cap):
    """A short extend after a cached prefix (causal, under FUSED_MIN_QUERIES: the two products) and a decode step,
    with a sliding window and a soft cap: the capped path and the window's mask against the explicit softmax."""
    torch.manual_seed(1)
    slots, heads, kv_heads, dim = 64, 6, 2, 8
    k_buffer, v_buffer = torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim)
    req_to_token = torch.randperm(slots).view(2, 32).to(torch.int32)
    prefix, new = 7, 5
    q = torch.randn(new, heads, dim)
    out = torch.empty(new, heads, dim)
    keys, allowed = extend_row_one_causally(q, out, k_buffer, v_buffer, req_to_token, prefix, new, sliding_window,
                                            logit_cap)
    want = sdpa(q, k_buffer[keys], v_buffer[keys], allowed, 0.3, logit_cap)
    assert torch.allclose(out, want, atol=1e-5)
    decoded = torch.empty(1, heads, dim)
    attention.decode_attention_cpu(q[:1], k_buffer, v_buffer, 1.0, 1.0, decoded, None, None, None, None, req_to_token,
                                   torch.tensor([1]), torch.tensor([prefix + new]), 0.3, logit_cap, False,
                                   sliding_window, None, None)
    want = sdpa(q[:1], k_buffer[keys], v_buffer[keys], allowed[-1:], 0.3, logit_cap)
    assert torch.allclose(decoded, want, atol=1e-5)


@pytest.mark.parametrize("prefix, sliding_window, logit_cap, fused", [
    (0, 0, 0.0, True), (9, 0, 0.0, True), (0, 40, 0.0, True), (9, 40, 0.0, True), (0, 0, 5.0, False)])
def test_a_prefill_runs_torchs_fused_attention_and_matches_the_explicit_softmax(monkeypatch, prefix, sliding_window,
                                                                                logit_cap, fused):
    """An extend of FUSED_MIN_QUERIES queries (a prefill: causal, after a cached prefix or not, windowed or not) runs
    torch's fused attention, and a capped one the two products; both against the explicit softmax, with grouped
    KV heads and a value width other than the key's (MLA's absorbed shapes)."""
    torch.manual_seed(2)
    new = attention.FUSED_MIN_QUERIES + 3
    slots, heads, kv_heads, dim, value_dim = 2 * (prefix + new) + 8, 6, 2, 8, 4
    k_buffer, v_buffer = torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, value_dim)
    req_to_token = torch.randperm(slots)[: 2 * (prefix + new)].view(2, -1).to(torch.int32)
    q = torch.randn(new, heads, dim)
    out = torch.empty(new, heads, value_dim)
    ran, fused_attention = [], attention._attend_fused
    monkeypatch.setattr(attention, "_attend_fused", lambda *args: ran.append("fused") or fused_attention(*args))
    keys, allowed = extend_row_one_causally(q, out, k_buffer, v_buffer, req_to_token, prefix, new, sliding_window,
                                            logit_cap)
    assert ran == (["fused"] if fused else [])
    want = sdpa(q, k_buffer[keys], v_buffer[keys], allowed, 0.3, logit_cap)
    assert torch.allclose(out, want, atol=1e-5)


def run_sampling_verify(target_probs: torch.Tensor, candidates: torch.Tensor, trials: int, rule) -> np.ndarray:
    """Emitted-token counts of the first position for one 2-level tree (root -> 2 children -> 1 grandchild each),
    SGLang's retrieve layout, fresh coins per trial."""
    n, vocab = candidates.shape[1], target_probs.shape[-1]
    next_token = torch.tensor([[1, 3, 4, -1, -1]])
    next_sibling = torch.tensor([[-1, 2, -1, -1, -1]])
    generator = torch.Generator().manual_seed(1)
    counts = np.zeros(vocab, dtype=np.int64)
    for _ in range(trials):
        predicts = torch.zeros(n, dtype=torch.int32)
        accept_index = torch.full((1, 3), -1, dtype=torch.int32)
        accepted = torch.zeros(1, dtype=torch.int32)
        rule(predicts, accept_index, accepted, candidates, torch.arange(n)[None], next_token, next_sibling,
             torch.rand(1, n, generator=generator), torch.rand(1, generator=generator), target_probs.clone(),
             torch.zeros_like(target_probs))
        counts[int(predicts[0])] += 1
    return counts


@pytest.mark.slow
def test_sampling_verify_stand_in_emits_exact_target_samples():
    """SGLang's target-only tree sampling (the stand-in SGLang calls on this CPU): the first emitted token is an exact
    sample of the target, whether a child is accepted or the residual is drawn; a rule that leaves rejected
    candidates in the residual is rejected by the same test."""
    target = torch.tensor([[0.30, 0.25, 0.2, 0.1, 0.1, 0.05]] * 5)[None]
    candidates = torch.tensor([[0, 1, 2, 3, 4]])  # root 0, children tokens 1 and 2, grandchildren 3 and 4
    expected = target[0, 0].double().numpy()
    expected = expected / expected.sum()
    trials = 6000
    counts = run_sampling_verify(target, candidates, trials, sampling.tree_speculative_sampling_target_only)
    assert stats.chisquare(counts, expected * trials).pvalue > 1e-3

    def biased(predicts, accept_index, accepted, candidates, retrieve, next_token, next_sibling, coins, final,
               target_probs, draft_probs):
        sampling.tree_speculative_sampling_target_only(
            predicts, accept_index, accepted, candidates, retrieve, next_token, next_sibling, coins, final,
            target_probs, torch.zeros_like(draft_probs).as_subclass(_WriteIgnored))

    counts = run_sampling_verify(target, candidates, trials, biased)
    assert stats.chisquare(counts, expected * trials).pvalue < 1e-6


class _WriteIgnored(torch.Tensor):
    """A draft_probs tensor whose writes are dropped: the biased control's residual keeps rejected candidates."""

    def __setitem__(self, index, value):
        return None
