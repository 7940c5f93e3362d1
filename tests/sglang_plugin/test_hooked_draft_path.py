"""The hooked draft path with tensors shaped as SGLang passes them, through SGLang's own downstream Triton twins
(build tree, greedy verify) under TRITON_INTERPRET=1."""

import numpy as np
import pytest
import torch

from helpers import targets_following_drafts
from sglang_spec.sglang_plugin import hooks
from sglang_spec.sglang_plugin.draft_tree import DevicePlan, DraftPlan
from sglang_spec.sglang_plugin.epilogue import AcceptEpilogue
from sglang_spec.sglang_plugin.metrics import AcceptanceMetrics
from sglang_spec.tree import (
    AcceptanceProfile,
    SyntheticCandidates,
    TokenTree,
    TreeBatch,
    TreeMaskMode,
    decode_sglang_draft,
    sequoia_plan,
)
from sglang_spec.verify import verify_greedy

pytestmark = pytest.mark.sglang
PROFILE = AcceptanceProfile.uniform([0.55, 0.2, 0.1, 0.05])


class FakePool:
    """A draft KV pool with one MLA-style layer whose rows record which (step, beam) wrote them."""

    def __init__(self, slots):
        self.kv_buffer = [torch.full((slots, 1, 2), -1.0)]


def run_draft_loop(spec_utils, eagle_utils, source, roots, topk, steps, num_draft_tokens, setup, pool=None):
    """SGLang's draft loop (draft_forward's select / organize calls) with a synthetic drafter; the hooks see a
    DraftContext exactly as our draft_forward hook would set it. Returns organize's outputs and, per step, the
    beams' paths (token lists) to check ancestry against."""
    batch = len(roots)

    def top(paths):
        distributions = torch.stack([source.distribution(path) for path in paths])
        return torch.topk(distributions, topk, dim=-1)

    step_locs = torch.arange(batch * topk * steps).view(batch, topk, steps).permute(2, 0, 1).reshape(steps, -1)
    token = hooks._DRAFT.set(hooks.DraftContext(setup, step_locs, pool))
    try:
        topk_p, topk_index = top([[root] for root in roots])
        beam_paths = [[[root, int(t)] for t in topk_index[row]] for row, root in enumerate(roots)]
        score_list, token_list, parents_list = [], [], []
        scores = None
        for step in range(steps):
            input_ids, _, scores, tree_info = spec_utils.select_top_k_tokens(step, topk_p, topk_index, None, scores, topk)
            if step > 0:
                chosen = tree_info[2] - (topk * topk * (step - 1) + topk)
                tokens = input_ids.view(batch, topk)
                beam_paths = [[beam_paths[r][int(c) // topk] + [int(tokens[r, j])] for j, c in enumerate(chosen[r])]
                              for r in range(batch)]
            score_list.append(tree_info[0])
            token_list.append(tree_info[1])
            parents_list.append(tree_info[2])
            if step == steps - 1:
                break
            if pool is not None:  # the draft forward at this step writes each beam's KV row at its column slot
                for row in range(batch):
                    for beam in range(topk):
                        slot = int(step_locs[step, row * topk + beam])
                        pool.kv_buffer[0][slot] = torch.tensor([[step, hash(tuple(beam_paths[row][beam])) % 10_000]])
                check_columns(pool, step_locs, beam_paths, batch, topk, step)
            topk_p, topk_index = top([path for row in beam_paths for path in row])
        outputs = eagle_utils.organize_draft_results(score_list, token_list, parents_list, num_draft_tokens)
    finally:
        hooks._DRAFT.reset(token)
    return outputs


def check_columns(pool, step_locs, beam_paths, batch, topk, step):
    """Every beam's column holds the KV of its own ancestors (the prefixes of its path), in order."""
    for row in range(batch):
        for beam in range(topk):
            path = beam_paths[row][beam]
            for earlier in range(step + 1):
                slot = int(step_locs[earlier, row * topk + beam])
                expected = hash(tuple(path[: earlier + 2])) % 10_000
                assert int(pool.kv_buffer[0][slot, 0, 1]) == expected, (row, beam, earlier)


@pytest.fixture
def uncompiled(monkeypatch, sglang_with_plugin):
    """SGLang's _select_top_k_tokens_later is torch.compile'd; run its Python body on CPU."""
    from sglang.srt.speculative import spec_utils

    monkeypatch.setattr(spec_utils, "_select_top_k_tokens_later", spec_utils._select_top_k_tokens_later.__wrapped__)
    from sglang.srt.speculative import eagle_utils

    return spec_utils, eagle_utils


@pytest.mark.parametrize("budget, steps, topk", [(10, 4, 3), (15, 5, 4), (6, 3, 2)])
def test_sequoia_plan_through_sglangs_build_tree_and_greedy_verify(uncompiled, sglang_kernels, budget, steps, topk):
    spec_utils, eagle_utils = uncompiled
    plan_tree = sequoia_plan(PROFILE, budget, steps, max_branch=topk)
    tree = TokenTree.from_parents(list(plan_tree.parents), ranks=list(plan_tree.ranks))
    setup = hooks.DraftSetup(DevicePlan.build(DraftPlan.from_tree(tree, topk, steps), "cpu"), exact_ancestry=False,
                             topk=topk, steps=steps)
    source = SyntheticCandidates(vocab_size=60, seed=budget, sharpness=1.5)
    roots = [7, 8, 9]
    parent_list, top_scores_index, draft_tokens = run_draft_loop(
        spec_utils, eagle_utils, source, roots, topk, steps, budget + 1, setup)
    # SGLang's own parent rule recovers exactly the Sequoia topology, with each node's rank-r candidate as token
    decoded = decode_sglang_draft(parent_list, top_scores_index, draft_tokens, torch.tensor(roots), topk)
    for root, got in zip(roots, decoded):
        assert got.parents.tolist() == list(plan_tree.parents)
        for node in range(1, got.num_nodes):
            path = [int(t) for t in got.tokens[got.path(node)[:-1]]]
            ranked = torch.argsort(source.distribution(path), descending=True, stable=True)
            assert int(ranked[plan_tree.ranks[node]]) == int(got.tokens[node])
    # SGLang's build-tree and greedy-verify Triton twins on these outputs accept what our reference accepts
    from sglang_spec.tree import SGLangDraftEncoding

    encoding = SGLangDraftEncoding(torch.tensor(roots), parent_list, top_scores_index, draft_tokens, topk, steps,
                                   budget + 1)
    built = sglang_kernels.build_tree(encoding, torch.tensor([5, 9, 2]), TreeMaskMode.QLEN_ONLY)
    rng = np.random.default_rng(budget)
    target = targets_following_drafts(rng, decoded, budget + 1, accept_rate=0.9, vocab_size=60)
    candidates = torch.cat([torch.tensor(roots)[:, None], draft_tokens], dim=1)
    predicts, accept_index, accept_num = sglang_kernels.verify_greedy(
        candidates, built.retrieve_index, built.retrieve_next_token, built.retrieve_next_sibling, target, steps + 1)
    ours = verify_greedy(TreeBatch.from_trees(decoded), target)
    assert accept_num.tolist() == (ours.accept_length - 1).tolist()
    for row in range(3):
        accepted = [int(predicts[int(i)]) for i in accept_index[row] if int(i) >= 0]
        assert accepted == ours.tokens(row)
    assert int(ours.accept_length.max()) >= 3


def test_hooked_draft_path_reads_nothing_on_the_host(uncompiled):
    """The sequoia plan and exact ancestry inside SGLang's draft loop: no host read, no tensor built from Python
    data (a host-to-device copy that SGLang's draft CUDA graph could not capture) in our hooks."""
    from host_guard import HostAccessGuard

    spec_utils, eagle_utils = uncompiled
    topk, steps, budget = 4, 4, 15
    plan_tree = sequoia_plan(PROFILE, budget, steps, max_branch=topk)
    tree = TokenTree.from_parents(list(plan_tree.parents), ranks=list(plan_tree.ranks))
    setup = hooks.DraftSetup(DevicePlan.build(DraftPlan.from_tree(tree, topk, steps), "cpu"), exact_ancestry=True,
                             topk=topk, steps=steps)
    source = SyntheticCandidates(vocab_size=60, seed=2, sharpness=1.5)
    pool = FakePool(2 * topk * steps)
    with HostAccessGuard(host_only=True) as guard:
        run_draft_loop(spec_utils, eagle_utils, source, [7, 8], topk, steps, budget + 1, setup, pool)
    assert guard.events == []
    with HostAccessGuard(host_only=True) as control:  # building the plan at start-up does copy from the host
        DevicePlan.build(DraftPlan.from_tree(tree, topk, steps), "cpu")
    assert any("draft_tree.py" in event for event in control.events)


def test_exact_ancestry_by_kv_column_permutation(uncompiled):
    """With the hook, after every frontier choice each beam's draft KV column holds its own ancestors; SGLang's
    loop alone would leave re-parented beams reading another beam's history (the negative control)."""
    spec_utils, eagle_utils = uncompiled
    topk, steps = 3, 5
    source = SyntheticCandidates(vocab_size=40, seed=3, sharpness=1.0)
    setup = hooks.DraftSetup(None, exact_ancestry=True, topk=topk, steps=steps)
    pool = FakePool(2 * topk * steps)
    run_draft_loop(spec_utils, eagle_utils, source, [4, 5], topk, steps, 12, setup, pool)  # asserts inside
    without = hooks.DraftSetup(None, exact_ancestry=False, topk=topk, steps=steps)
    with pytest.raises(AssertionError):
        run_draft_loop(spec_utils, eagle_utils, source, [4, 5], topk, steps, 12, without, FakePool(2 * topk * steps))


def test_without_a_draft_context_sglang_behaviour_is_unchanged(uncompiled, sglang_eagle):
    """Outside our draft_forward hook (tree options unset) the hooked functions return SGLang's own results."""
    source = SyntheticCandidates(vocab_size=50, seed=11, sharpness=1.0)
    theirs = sglang_eagle.run(source, [3, 4], 3, 3, 10)
    spec_utils, eagle_utils = uncompiled
    # the same loop through the hooked public functions, no context set
    token = hooks._DRAFT.set(None)
    try:
        ours = run_draft_loop(spec_utils, eagle_utils, source, [3, 4], 3, 3, 10,
                              hooks.DraftSetup(None, False, 3, 3))
    finally:
        hooks._DRAFT.reset(token)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_metrics_hook_counts_acceptance_per_position(sglang_with_plugin, monkeypatch):
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import Req

    metrics = AcceptanceMetrics()
    monkeypatch.setattr(hooks, "METRICS", metrics)
    request = SimpleNamespace(spec_correct_drafts_histogram=[])
    for accepted in [0, 2, 3, 3, 1]:
        Req.update_spec_correct_drafts_histogram(request, accepted)
    assert request.spec_correct_drafts_histogram == [1, 1, 1, 2]  # SGLang's own bookkeeping still runs
    assert metrics.rates() == [4 / 5, 3 / 5, 2 / 5]
    assert metrics.mean_accept_length() == pytest.approx(1 + 9 / 5)


def test_in_graph_epilogue_matches_sglangs_greedy_verify(sglang_kernels):
    """Our capture-tail epilogue (fused target tokens + accept walk) returns what eagle_sample returns for greedy
    batches: predict, accept_index and the accepted-draft counts of verify_tree_greedy."""
    from helpers import random_tree

    from sglang_spec.tree import encode_sglang_verify

    rng = np.random.default_rng(0)
    trees = [random_tree(rng, 9, 3, 4, vocab_size=30) for _ in range(3)]
    meta = encode_sglang_verify(trees, [4, 4, 4])
    target = targets_following_drafts(rng, trees, 9, accept_rate=0.85, vocab_size=30)
    logits = torch.nn.functional.one_hot(target.reshape(-1), 30).float() * 5 + torch.rand(27, 30)
    predicts, accept_index, accept_num = sglang_kernels.verify_greedy(
        meta.draft_tokens.view(3, 9), meta.retrieve_index, meta.retrieve_next_token, meta.retrieve_next_sibling,
        logits.argmax(-1).view(3, 9), 5)
    batch = TreeBatch.from_trees(trees)
    static = AcceptEpilogue(9, 4).run(logits, batch.tokens, batch.parents, batch.num_nodes)
    assert torch.equal(static.accept_index, accept_index)
    assert torch.equal(static.num_correct_drafts, accept_num)
    written = accept_index[accept_index >= 0].long()
    assert torch.equal(static.predict[written], predicts[written])
