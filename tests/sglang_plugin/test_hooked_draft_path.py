"""The draft paths with tensors shaped as SGLang passes them: the plugin's own loop (sequoia, specexec: any number
of expanded nodes per level up to the width W, each node's top-K children, exact ancestry) and SGLang's loop with
the exact-ancestry hook (eagle), through SGLang's own downstream Triton twins (build tree, greedy verify) under
TRITON_INTERPRET=1."""

import numpy as np
import pytest
import torch

from doubles import SyntheticCandidates, plugin_worker_state
from helpers import targets_following_drafts
from sglang_spec.errors import SpecError
from sglang_spec.sglang_plugin.drafters.beams import permute_kv
from sglang_spec.sglang_plugin.drafters.head_loop import HeadLoopDrafter
from sglang_spec.sglang_plugin.state import SGLangLoopStep
from sglang_spec.sglang_plugin.hooks import draft as hooks
from sglang_spec.sglang_plugin.options import TreeServerOptions
from sglang_spec.sglang_plugin.state import SGLANG_LOOP_STEP, attach
from sglang_spec.sglang_plugin.drafters.beam_selection import (
    DraftLoop,
    DraftPlan,
    ancestry_permutation,
    growable_beams,
    specexec_width,
    widest_level,
)
from sglang_spec.sglang_plugin.metrics import AcceptanceMetrics
from sglang_spec.tree import (
    AcceptanceProfile,
    TreePolicy,
    TreeBatch,
    TreeMaskMode,
    decode_sglang_draft,
)
from sglang_spec.verify import verify_greedy
from sglang_spec.tree.proposal import DraftSources

pytestmark = pytest.mark.sglang
PROFILE = AcceptanceProfile.uniform([0.55, 0.2, 0.1, 0.05])


class FakePool:
    """A draft KV pool with one MLA-style layer whose rows record which (step, beam) wrote them."""

    def __init__(self, slots):
        self.kv_buffer = [torch.full((slots, 1, 2), -1.0)]


def run_draft_loop(spec_utils, eagle_utils, source, roots, topk, steps, num_draft_tokens, exact_ancestry, pool=None):
    """SGLang's draft loop (draft_forward's select / organize calls) with a synthetic drafter; the hooks see an
    ``SGLangLoopStep`` exactly as ``SGLangLoopDrafter.draft`` would set it. Returns organize's outputs and, per step,
    the beams' paths (token lists) to check ancestry against."""
    batch = len(roots)

    def top(paths):
        distributions = torch.stack([source.distribution(path) for path in paths])
        return torch.topk(distributions, topk, dim=-1)

    step_locs = torch.arange(batch * topk * steps).view(batch, topk, steps).permute(2, 0, 1).reshape(steps, -1)
    token = SGLANG_LOOP_STEP.set(SGLangLoopStep(step_locs, pool, steps, exact_ancestry))
    try:
        topk_p, topk_index = top([[root] for root in roots])
        beam_paths = [[[root, int(t)] for t in topk_index[row]] for row, root in enumerate(roots)]
        score_list, token_list, parents_list = [], [], []
        scores = None
        for step in range(steps):
            input_ids, _, scores, tree_info = spec_utils.select_top_k_tokens(step, topk_p, topk_index, None, scores,
                                                                             topk)
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
        SGLANG_LOOP_STEP.reset(token)
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


def run_own_loop(loop: DraftLoop, source, roots, budget, pool=None):
    """``draft_forward.draft_forward`` with a synthetic drafter in place of SGLang's draft model: the same DraftLoop
    calls, the same per-step KV slots and the same ancestry permutation. Returns SGLang's (parent_list,
    top_scores_index, draft_tokens)."""
    batch, width, steps = len(roots), loop.width, loop.steps

    def top(paths):
        distributions = torch.stack([source.distribution(path) for path in paths])
        return torch.topk(distributions, width, dim=-1)

    step_locs = torch.arange(batch * width * steps).view(batch, width, steps).permute(2, 0, 1).reshape(steps, -1)
    topk_p, topk_index = top([[root] for root in roots])
    level = loop.root_level(topk_p, topk_index)
    levels = [level]
    beam_paths = [[[root, int(t)] for t in topk_index[row]] for row, root in enumerate(roots)]
    for step in range(1, steps):
        if pool is not None:  # the forward at step - 1 writes each beam's KV row at its column slot
            for row in range(batch):
                for beam in range(width):
                    slot = int(step_locs[step - 1, row * width + beam])
                    pool.kv_buffer[0][slot] = torch.tensor([[step - 1, hash(tuple(beam_paths[row][beam])) % 10_000]])
            check_columns(pool, step_locs, beam_paths, batch, width, step - 1)
        topk_p, topk_index = top([path for row in beam_paths for path in row])
        level = loop.next_level(step, level.beam_scores, topk_p, topk_index)
        levels.append(level)
        tokens = level.beam_tokens.view(batch, width)
        beam_paths = [[beam_paths[r][int(level.parent_beam[r, j])] + [int(tokens[r, j])] for j in range(width)]
                      for r in range(batch)]
        if step < steps - 1 and pool is not None:
            target, source_slots = ancestry_permutation(level.parent_beam, step_locs, step)
            permute_kv(pool, target, source_slots)
    return loop.organize(levels, budget)


@pytest.fixture
def uncompiled(monkeypatch, sglang_with_plugin):
    """SGLang's _select_top_k_tokens_later is torch.compile'd; run its Python body on CPU."""
    from sglang.srt.speculative import spec_utils

    monkeypatch.setattr(spec_utils, "_select_top_k_tokens_later", spec_utils._select_top_k_tokens_later.__wrapped__)
    from sglang.srt.speculative import eagle_utils

    return spec_utils, eagle_utils


def sequoia_loop(budget, steps, topk, width=None):
    """The plan's loop as the server builds it: beams off the plan masked (``budget``)."""
    tree = TreePolicy("sequoia", budget=budget, depth=steps, topk=topk, profile=PROFILE).static_shape()
    assert tree is not None
    width = width or max(topk, widest_level(tree))
    return tree, DraftLoop.build(width, topk, steps, DraftPlan.from_tree(tree, width, steps), "cpu", budget=budget)


def paths_of(tree):
    return {tuple(int(t) for t in tree.tokens[tree.path(node)]) for node in range(1, tree.num_nodes)}


@pytest.mark.parametrize("budget, steps, topk", [(10, 4, 3), (15, 5, 4), (6, 3, 2), (32, 5, 4), (64, 6, 4)])
def test_sequoia_through_the_own_loop_and_sglangs_build_tree_and_greedy_verify(sglang_kernels, budget, steps, topk):
    """The DP tree, wider than topk on some level at the larger budgets, comes out of the loop exactly (each node
    the rank-r candidate of its parent) and SGLang's build-tree / greedy-verify twins accept on it what our
    reference accepts."""
    plan_tree, loop = sequoia_loop(budget, steps, topk)
    source = SyntheticCandidates(vocab_size=60, seed=budget, sharpness=1.5)
    roots = [7, 8, 9]
    parent_list, top_scores_index, draft_tokens = run_own_loop(loop, source, roots, budget)
    # SGLang's own parent rule (slot // W) recovers exactly the Sequoia topology
    decoded = decode_sglang_draft(parent_list, top_scores_index, draft_tokens, torch.tensor(roots), loop.width)
    for got in decoded:
        assert got.parents.tolist() == plan_tree.parents.tolist()
        for node in range(1, got.num_nodes):
            path = [int(t) for t in got.tokens[got.path(node)[:-1]]]
            ranked = torch.argsort(source.distribution(path), descending=True, stable=True)
            assert int(ranked[int(plan_tree.ranks[node])]) == int(got.tokens[node])
    from sglang_spec.tree import SGLangDraftEncoding

    encoding = SGLangDraftEncoding(torch.tensor(roots), parent_list, top_scores_index, draft_tokens, loop.width,
                                   steps, budget + 1)
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


def test_sequoia_trees_wider_than_topk_are_laid_out():
    """Budget 32 / depth 5 / topk 4 expands more than 4 nodes on a level: SGLang's own loop (width = topk) cannot
    hold it, the plugin's loop with width = the widest level can."""
    tree = TreePolicy("sequoia", budget=32, depth=5, topk=4, profile=PROFILE).static_shape()
    assert tree is not None
    assert widest_level(tree) > 4
    with pytest.raises(SpecError, match="frontier holds 4"):
        DraftPlan.from_tree(tree, 4, 5)
    DraftPlan.from_tree(tree, widest_level(tree), 5)


@pytest.mark.parametrize("budget, steps, topk, width", [(16, 5, 4, 16), (32, 6, 4, 32), (24, 4, 3, 6), (8, 3, 2, 2)])
def test_specexec_through_the_own_loop_is_the_reference_tree(budget, steps, topk, width):
    """Best-first on the device (each level's best W candidates, then the best budget of all) gives the reference
    decoder's SpecExec tree with the same width bound: exactly SpecExec's when W = budget."""
    source = SyntheticCandidates(vocab_size=40, seed=budget + width, sharpness=1.2)
    roots = [3, 4]
    loop = DraftLoop.build(width, topk, steps, None, "cpu")
    parent_list, top_scores_index, draft_tokens = run_own_loop(loop, source, roots, budget)
    decoded = decode_sglang_draft(parent_list, top_scores_index, draft_tokens, torch.tensor(roots), width)
    for root, got in zip(roots, decoded):
        reference = TreePolicy("specexec", budget=budget, depth=steps, topk=topk,
                               width=width).build(root, DraftSources(mtp=source)).tree
        assert paths_of(got) == paths_of(reference)
        assert int(got.ranks[1:].max()) < topk


class ScriptedCandidates(SyntheticCandidates):
    """A drafter whose next-token distribution is scripted per path (tokens 1..4, the rest 0), default
    [0.3, 0.3, 0.3, 0.1]. ``SPECEXEC_15_4_4``: specexec 15/4/4's tree has a child under the 11th-ranked node of
    level 2 (levels 1 / 2 / 3: 3 / 11 / 1 nodes), the widest growth the budget allows there (``growable_beams``)."""

    def __init__(self, script: dict[tuple[int, ...], list[float]], vocab_size: int = 12) -> None:
        super().__init__(vocab_size)
        self.script = script

    def distribution(self, path_tokens):
        probs = torch.zeros(self.vocab_size)
        probs[1:5] = torch.tensor(self.script.get(tuple(int(t) for t in path_tokens[1:]), [0.3, 0.3, 0.3, 0.1]))
        return probs


SPECEXEC_15_4_4 = {(): [0.33, 0.33, 0.33, 0.01], (1,): [0.3, 0.3, 0.28, 0.12], (2,): [0.3, 0.3, 0.29, 0.11],
                   (3,): [0.3, 0.3, 0.3, 0.1], (2, 4): [0.95, 0.03, 0.01, 0.01]}


def exact_specexec(budget, steps, topk, source, root):
    """SpecExec's tree without a width bound (the reference decoder's policy)."""
    return TreePolicy("specexec", budget=budget, depth=steps, topk=topk).build(root, DraftSources(mtp=source)).tree


@pytest.mark.parametrize("budget, steps, topk", [(15, 4, 4), (16, 5, 4), (32, 6, 4), (24, 4, 3), (10, 5, 2),
                                                 (40, 4, 3)])
def test_specexec_over_the_beams_that_can_grow_is_exactly_specexecs_tree(budget, steps, topk):
    """The default width (``specexec_width``: 11 at 15/4/4, where it was the budget) with the beams past
    ``growable_beams`` masked draws exactly SpecExec's unbounded tree, for flat drafters (wide levels) and sharp
    ones (deep paths)."""
    width = specexec_width(budget, steps, topk)
    assert topk <= width < budget
    loop = DraftLoop.build(width, topk, steps, None, "cpu", budget=budget)
    assert loop.live == growable_beams(budget, steps, topk)[: steps - 1]
    roots = [3, 4, 5]
    for seed, sharpness in [(1, 0.05), (2, 0.5), (3, 1.5), (4, 4.0)]:
        source = SyntheticCandidates(vocab_size=40, seed=seed * 100 + budget, sharpness=sharpness)
        parent_list, top_scores_index, draft_tokens = run_own_loop(loop, source, roots, budget)
        decoded = decode_sglang_draft(parent_list, top_scores_index, draft_tokens, torch.tensor(roots), width)
        for root, got in zip(roots, decoded):
            assert paths_of(got) == paths_of(exact_specexec(budget, steps, topk, source, root)), (seed, root)


def test_the_growable_bound_is_reached():
    """Specexec 15/4/4 can grow the 11th-ranked beam of level 2 (scripted drafter): width 11 draws SpecExec's tree,
    width 10 misses the child under that beam (the negative control: the bound is tight there)."""
    assert growable_beams(15, 4, 4) == (4, 11, 10) and specexec_width(15, 4, 4) == 11
    source = ScriptedCandidates(SPECEXEC_15_4_4)
    exact = exact_specexec(15, 4, 4, source, 0)
    assert [int((exact.depths == depth).sum()) for depth in (1, 2, 3)] == [3, 11, 1]
    for width, equal in ((11, True), (10, False)):
        loop = DraftLoop.build(width, 4, 4, None, "cpu", budget=15)
        got = decode_sglang_draft(*run_own_loop(loop, source, [0], 15), torch.tensor([0]), width)[0]
        assert (paths_of(got) == paths_of(exact)) is equal, width


class PathDraftModel:
    """SGLang's draft runner for ``draft_forward.draft_forward``, over a scripted drafter: a row's hidden state is
    the id of its path, a forward extends it by the row's input token and returns the path's log-probabilities.
    Like SGLang's logits processor it computes the head over ``LOGIT_ROWS`` only (and keeps those rows' last hidden
    states); records (rows through the layers, rows through the head) per forward."""

    def __init__(self, source, roots):
        self.source = source
        self.paths = [[root] for root in roots]
        self.rows: list[tuple[int, int]] = []

    def forward(self, forward_batch):
        from types import SimpleNamespace

        from sglang_spec.sglang_plugin.state import LOGIT_ROWS

        ids = []
        for parent, token in zip(forward_batch.spec_info.hidden_states[:, 0].long().tolist(),
                                 forward_batch.input_ids.tolist()):
            self.paths.append(self.paths[parent] + [token])
            ids.append(len(self.paths) - 1)
        rows = LOGIT_ROWS.get()
        head = list(range(len(ids))) if rows is None else rows.tolist()
        self.rows.append((len(ids), len(head)))
        logits = torch.stack([torch.log(self.source.distribution(self.paths[ids[row]]) + 1e-30) for row in head])
        hidden = torch.tensor([[float(ids[row])] for row in head])
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=logits, hidden_states=hidden))


def draft_worker(loop: DraftLoop, source, roots, budget):
    """(worker, forward_batch, model): SGLang's draft worker and draft-step batch as the plugin's draft reads them,
    with ``PathDraftModel`` as the draft runner."""
    from types import SimpleNamespace

    batch, width, steps = len(roots), loop.width, loop.steps
    model = PathDraftModel(source, roots)
    root_p, root_index = torch.topk(torch.stack([source.distribution([root]) for root in roots]), width, dim=-1)
    spec_info = SimpleNamespace(topk_p=root_p, topk_index=root_index, bonus_tokens=torch.tensor(roots),
                                hidden_states=torch.arange(batch, dtype=torch.float32)[:, None])
    forward_batch = SimpleNamespace(spec_info=spec_info, batch_size=batch, out_cache_loc=torch.arange(
        batch * width * steps), positions=torch.zeros(batch * width, dtype=torch.int64), input_ids=None,
        moe_num_token_non_padded=None, sampling_info=None, forward_mode=SimpleNamespace(is_idle=lambda: False))
    runner = SimpleNamespace(token_to_kv_pool=FakePool(batch * width * steps), forward=model.forward,
                             model_config=SimpleNamespace(model_is_mrope=False))
    worker = SimpleNamespace(hot_token_id=None, draft_runner=runner, speculative_num_draft_tokens=budget + 1,
                             topk=width, speculative_num_steps=steps,
                             draft_attn_backend=SimpleNamespace(attn_backends=[None] * steps))
    return worker, forward_batch, model


def run_draft_forward(loop: DraftLoop, source, roots, budget):
    """``draft_forward.draft_forward`` (the server's own-loop entry) with ``PathDraftModel`` as the draft runner."""
    from sglang_spec.sglang_plugin.drafters.head_loop import draft_forward

    worker, forward_batch, model = draft_worker(loop, source, roots, budget)
    parent_list, top_scores_index, draft_tokens, _ = draft_forward(worker, forward_batch, loop)
    width = loop.width
    trees = decode_sglang_draft(parent_list, top_scores_index, draft_tokens, torch.tensor(roots), width)
    return trees, model.rows


def test_the_draft_forwards_the_head_over_the_beams_that_can_grow_only(sglang_with_plugin):
    """Specexec 15/4/4 as the server builds it: W = 11 rows a request through the draft's layers (SGLang's
    attention metadata holds W beams) and the head over 4 / 11 / 10 rows at steps 1 / 2 / 3 (the root's 4
    candidates, then the growable ranks): 25 head rows a request where the loop ran 3 x 15 = 45 of each. The tree
    is still exactly SpecExec's, the growable bound reached included."""
    from sglang_spec.sglang_plugin.options import from_values

    options = from_values({"speculative_tree_policy": "specexec", "speculative_tree_budget": 15,
                           "speculative_tree_depth": 4, "speculative_tree_topk": 4})
    loop = DraftLoop.build(options.width, options.topk, options.depth, options.draft_plan(), "cpu",
                           budget=options.budget)
    assert (options.width, loop.live) == (11, (4, 11, 10))
    for source, roots in ((ScriptedCandidates(SPECEXEC_15_4_4), [0, 0]),
                          (SyntheticCandidates(vocab_size=40, seed=9, sharpness=0.5), [3, 4, 5])):
        trees, rows = run_draft_forward(loop, source, roots, 15)
        batch = len(roots)
        assert rows == [(batch * 11, batch * 4), (batch * 11, batch * 11), (batch * 11, batch * 10)]
        for root, got in zip(roots, trees):
            assert paths_of(got) == paths_of(exact_specexec(15, 4, 4, source, root))


def test_sequoia_forwards_the_head_over_the_plans_expanded_nodes_only(sglang_with_plugin):
    """Sequoia 32/5/4: the head runs over the beams holding the plan's nodes with children at each step, and the
    drafted tree is still the plan."""
    plan_tree, loop = sequoia_loop(32, 5, 4)
    expanded = [sum(1 for node in range(1, plan_tree.num_nodes) if int(plan_tree.depths[node]) == depth
                    and bool((plan_tree.parents == node).any())) for depth in range(1, 5)]
    assert list(loop.live) == expanded and max(expanded) == loop.width and min(expanded) < loop.width
    source = SyntheticCandidates(vocab_size=60, seed=4, sharpness=1.5)
    trees, rows = run_draft_forward(loop, source, [7, 8], 32)
    assert rows == [(2 * loop.width, 2 * live) for live in loop.live]
    for got in trees:
        assert got.parents.tolist() == plan_tree.parents.tolist()


def test_a_context_trees_head_round_runs_its_lm_head_over_the_beams_holding_nodes(sglang_with_plugin):
    """A lookup / hybrid head round (``beams.head_round``) over 2 requests x W = 4 beams whose nodes sit on 3 of
    the 8 beams: every beam goes through the head's layer, the LM head over those 3 alone; their candidates and
    states are the ones a round over every beam gives, the other beams' zeros (nothing reads them). Control:
    without ``node_beams`` the LM head runs over all 8."""
    from sglang_spec.sglang_plugin.drafters.beams import head_round

    loop = DraftLoop.build(4, 2, 3, None, "cpu", budget=6)
    source = SyntheticCandidates(vocab_size=40, seed=5, sharpness=1.0)
    tokens = torch.tensor([[11, 12, 0, 0], [13, 0, 0, 0]])
    own_column = torch.arange(4).repeat(2, 1)
    node_beams = torch.tensor([0, 1, 4])
    rounds = {}
    for name, selected in (("nodes", node_beams), ("all", None)):
        worker, forward_batch, model = draft_worker(loop, source, [3, 4], 6)
        step_locs = torch.arange(2 * 4 * 3).view(3, 8)
        output, topk_p, topk_index = head_round(worker, forward_batch, 1, tokens, own_column,
                                                forward_batch.spec_info.hidden_states, step_locs, 2, selected)
        rounds[name] = (model.rows, output.hidden_states, topk_p, topk_index)
    assert rounds["nodes"][0] == [(8, 3)] and rounds["all"][0] == [(8, 8)]
    others = torch.tensor([2, 3, 5, 6, 7])
    for got, full in zip(rounds["nodes"][1:], rounds["all"][1:]):
        assert got.shape == full.shape
        assert torch.equal(got[node_beams], full[node_beams]) and not got[others].any()
    assert rounds["all"][2][others].any()  # the control's other beams did get candidates


def test_an_impossible_plan_at_run_time_is_a_draft_fault(sglang_with_plugin, monkeypatch, capsys):
    """Where the own loop can meet an impossible plan at run time: organize lays the sequoia plan's slots over the
    tokens SGLang verifies, and a plan of 15 nodes under a worker verifying 16 cannot be laid (checked at start-up,
    so only a bug or a changed SGLang gets here). The SpecError is a draft fault: the batch verifies the filler
    tree of SGLang's shape, counted and logged in one line."""
    _, loop = sequoia_loop(15, 4, 4)
    metrics = AcceptanceMetrics()
    monkeypatch.setattr(hooks, "METRICS", metrics)
    source = SyntheticCandidates(vocab_size=60, seed=4, sharpness=1.5)
    worker, forward_batch, _ = draft_worker(loop, source, [7, 8], 16)
    attach(worker, plugin_worker_state(TreeServerOptions("sequoia", 15, 4, 4, loop.width),
                                       HeadLoopDrafter(loop, guard=None), width=loop.width, steps=4, budget=16))

    def sglangs_draft_forward(*args):
        raise AssertionError("the own loop replaces SGLang's")

    _, _, draft_tokens, _ = hooks.draft_forward_around(sglangs_draft_forward, worker, forward_batch)
    assert draft_tokens.shape == (2, 16) and metrics.draft_faults == {"SpecError": 1}
    lines = [line for line in capsys.readouterr().err.splitlines() if "draft fault" in line]
    assert len(lines) == 1 and "the plan has 15 draft nodes but SGLang verifies 16" in lines[0]


def test_sglangs_logits_processor_selects_the_rows_in_decode_mode(sglang_with_plugin):
    """The hook's row selection reaches SGLang's own logits processor: in a DECODE forward (the draft's), with
    ``draft_extend_select_index`` set by ``logits_metadata_after``, the head's input and the last hidden states are
    those rows; outside the plugin's draft forward nothing is selected."""
    from types import SimpleNamespace

    from sglang.srt.layers.logits_processor import LogitsMetadata, LogitsProcessor
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

    from sglang_spec.sglang_plugin.state import LOGIT_ROWS

    hidden = torch.arange(24, dtype=torch.float32).view(8, 3)
    rows = torch.tensor([0, 1, 4, 5])
    for selected in (rows, None):
        metadata = LogitsMetadata(forward_mode=ForwardMode.DECODE, capture_hidden_mode=CaptureHiddenMode.LAST)
        token = LOGIT_ROWS.set(selected)
        try:
            metadata = hooks.logits_metadata_after(metadata, LogitsMetadata)
        finally:
            LOGIT_ROWS.reset(token)
        pruned, _, aux, sample_indices, _, _ = LogitsProcessor._get_pruned_states(SimpleNamespace(), hidden, None,
                                                                                   None, metadata)
        stored = LogitsProcessor._get_hidden_states_to_store(SimpleNamespace(), hidden, None, None, pruned, None, aux,
                                                              sample_indices, metadata)
        expected = hidden if selected is None else hidden[rows]
        assert torch.equal(pruned, expected) and torch.equal(stored, expected) and sample_indices is None


def test_own_loop_reads_nothing_on_the_host():
    """The plugin's loop (tree code, ancestry permutation, organize): no host read and no tensor built from Python
    data (a host-to-device copy SGLang's draft CUDA graph could not capture)."""
    from host_guard import HostAccessGuard

    for plan in (True, False):
        loop = sequoia_loop(32, 5, 4)[1] if plan else DraftLoop.build(16, 4, 5, None, "cpu")
        source = SyntheticCandidates(vocab_size=60, seed=2, sharpness=1.5)
        pool = FakePool(2 * loop.width * loop.steps)
        step_locs = torch.arange(2 * loop.width * loop.steps).view(loop.steps, -1)
        topk_p, topk_index = torch.topk(torch.stack([source.distribution([r]) for r in (7, 8)]), loop.width, dim=-1)
        next_p = torch.rand(2 * loop.width, loop.width).sort(dim=-1, descending=True).values
        next_index = torch.randint(60, (2 * loop.width, loop.width))
        with HostAccessGuard(host_only=True) as guard:
            levels = [loop.root_level(topk_p, topk_index)]
            for step in range(1, loop.steps):
                levels.append(loop.next_level(step, levels[-1].beam_scores, next_p, next_index))
                target, source_slots = ancestry_permutation(levels[-1].parent_beam, step_locs, step)
                permute_kv(pool, target, source_slots)
            loop.organize(levels, 32 if plan else 16)
        assert guard.events == []
    with HostAccessGuard(host_only=True) as control:  # building the loop at start-up does copy from the host
        sequoia_loop(32, 5, 4)
    assert any("beam_selection.py" in event for event in control.events)


def test_own_loop_keeps_exact_ancestry():
    source = SyntheticCandidates(vocab_size=40, seed=6, sharpness=1.0)
    _, loop = sequoia_loop(32, 5, 4)
    run_own_loop(loop, source, [4, 5], 32, FakePool(2 * loop.width * loop.steps))  # asserts inside
    loop = DraftLoop.build(12, 3, 5, None, "cpu")
    run_own_loop(loop, source, [4, 5], 20, FakePool(2 * 12 * 5))

def test_exact_ancestry_by_kv_column_permutation(uncompiled):
    """With the hook, after every frontier choice each beam's draft KV column holds its own ancestors; SGLang's
    loop alone would leave re-parented beams reading another beam's history (the negative control)."""
    spec_utils, eagle_utils = uncompiled
    topk, steps = 3, 5
    source = SyntheticCandidates(vocab_size=40, seed=3, sharpness=1.0)
    pool = FakePool(2 * topk * steps)
    run_draft_loop(spec_utils, eagle_utils, source, [4, 5], topk, steps, 12, True, pool)  # asserts inside
    with pytest.raises(AssertionError):
        run_draft_loop(spec_utils, eagle_utils, source, [4, 5], topk, steps, 12, False, FakePool(2 * topk * steps))


def test_without_a_draft_context_sglang_behaviour_is_unchanged(uncompiled, sglang_eagle):
    """Outside our draft_forward hook (tree options unset) the hooked functions return SGLang's own results."""
    source = SyntheticCandidates(vocab_size=50, seed=11, sharpness=1.0)
    theirs = sglang_eagle.run(source, [3, 4], 3, 3, 10)
    spec_utils, eagle_utils = uncompiled
    # the same loop through the hooked public functions, no step of SGLang's loop set
    assert SGLANG_LOOP_STEP.get() is None
    ours = run_draft_loop(spec_utils, eagle_utils, source, [3, 4], 3, 3, 10, False)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_metrics_hook_counts_acceptance_per_position(sglang_with_plugin, monkeypatch):
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import Req

    from sglang_spec.sglang_plugin.hooks import accept

    metrics = AcceptanceMetrics()
    monkeypatch.setattr(accept, "METRICS", metrics)
    request = SimpleNamespace(spec_correct_drafts_histogram=[])
    for accepted in [0, 2, 3, 3, 1]:
        Req.update_spec_correct_drafts_histogram(request, accepted)
    assert request.spec_correct_drafts_histogram == [1, 1, 1, 2]  # SGLang's own bookkeeping still runs
    assert metrics.rates() == [4 / 5, 3 / 5, 2 / 5]
    assert metrics.mean_accept_length() == pytest.approx(1 + 9 / 5)


@pytest.mark.parametrize("rank, counts", [(0, True), (1, False)])
def test_only_attention_tp_rank_zero_counts_acceptance(sglang_with_plugin, monkeypatch, rank, counts):
    """Every attention-TP rank runs the same verify for the same requests: counting on each would multiply the
    totals by the TP size, so the worker start-up on rank 1 registers nothing and its requests count nothing."""
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import Req

    from sglang_spec.sglang_plugin.state import OPTIONS_ATTRIBUTE as ATTRIBUTE

    metrics = AcceptanceMetrics()
    registered = []
    monkeypatch.setattr(metrics, "enable_prometheus", lambda: registered.append(True))
    from sglang_spec.sglang_plugin.hooks import accept

    monkeypatch.setattr(hooks, "METRICS", metrics)
    monkeypatch.setattr(accept, "METRICS", metrics)
    monkeypatch.setattr(hooks, "attention_tp_rank", lambda: rank)
    server_args = SimpleNamespace(enable_metrics=True, **{ATTRIBUTE: TreeServerOptions("eagle", 8, 4, 4, 4)})
    worker = SimpleNamespace(server_args=server_args, topk=4, speculative_num_steps=4,
                             speculative_num_draft_tokens=9, device="cpu")
    hooks.draft_worker_init_after(None, worker)
    request = SimpleNamespace(spec_correct_drafts_histogram=[])
    for accepted in [2, 3]:
        Req.update_spec_correct_drafts_histogram(request, accepted)
    assert request.spec_correct_drafts_histogram == [0, 0, 1, 1]  # SGLang's own bookkeeping runs on every rank
    assert registered == ([True] if counts else [])
    assert metrics.steps == (2 if counts else 0)


def drafted_levels(loop: DraftLoop, source, roots) -> list:
    """The levels the own loop drafts for ``roots`` with a synthetic drafter (no KV: run_own_loop without a pool)."""
    batch, width = len(roots), loop.width

    def top(paths):
        return torch.topk(torch.stack([source.distribution(path) for path in paths]), width, dim=-1)

    topk_p, topk_index = top([[root] for root in roots])
    levels = [loop.root_level(topk_p, topk_index)]
    paths = [[[root, int(t)] for t in topk_index[row]] for row, root in enumerate(roots)]
    for step in range(1, loop.steps):
        topk_p, topk_index = top([path for row in paths for path in row])
        level = loop.next_level(step, levels[-1].beam_scores, topk_p, topk_index)
        levels.append(level)
        tokens = level.beam_tokens.view(batch, width)
        paths = [[paths[r][int(level.parent_beam[r, j])] + [int(tokens[r, j])] for j in range(width)]
                 for r in range(batch)]
    return levels


def organize_picks_unusable(loop: DraftLoop, levels, budget: int) -> bool:
    """Whether organize verifies a slot the loop marked unusable (score -1: rank >= K or a dead beam's child)."""
    _, chosen, _ = loop.organize(levels, budget)
    scores = torch.cat([level.scores for level in levels], dim=1)
    return bool((torch.gather(scores, 1, chosen) < 0).any())


def resolved(width: int, steps: int):
    from types import SimpleNamespace

    return SimpleNamespace(speculative_algorithm="NEXTN", speculative_eagle_topk=width, speculative_num_steps=steps,
                           enable_multi_layer_eagle=False)


def test_specexec_capacity_counts_only_the_slots_the_loop_can_use():
    """specexec 16/3/2 (default width = budget 16): the root's 16 candidates hold 2 usable, each level after
    keeps 2 children of its usable beams: 2 + 4 + 8 = 14 slots, so organize would verify -1 slots (orphans)."""
    import itertools

    from sglang_spec.sglang_plugin.options import TreeServerOptions, validate_speculative

    source = SyntheticCandidates(vocab_size=50, seed=5, sharpness=1.0)
    loop = DraftLoop.build(16, 2, 3, None, "cpu")
    assert organize_picks_unusable(loop, drafted_levels(loop, source, [3, 4]), 16)  # what the launch would draft
    with pytest.raises(SpecError, match="exceeds the 14 draft tokens"):
        validate_speculative(TreeServerOptions("specexec", 16, 3, 2, 16), resolved(16, 3))
    from sglang_spec.sglang_plugin.drafters.beam_selection import usable_slots

    assert usable_slots(16, 2, 3) == 14 and usable_slots(4, 4, 3) == 4 + 2 * 4 * 4  # W = K: SGLang's own count
    accepted = refused = 0
    for budget, steps, topk, width in itertools.product((3, 6, 10, 16), (1, 2, 3), (1, 2, 3), (2, 3, 4, 16)):
        if topk > width:
            continue
        try:
            validate_speculative(TreeServerOptions("specexec", budget, steps, topk, width), resolved(width, steps))
        except SpecError:
            refused += 1
            continue
        accepted += 1
        loop = DraftLoop.build(width, topk, steps, None, "cpu")
        levels = drafted_levels(loop, source, [7, 9])
        assert not organize_picks_unusable(loop, levels, budget), (budget, steps, topk, width)
    assert accepted and refused
