"""``device_trees/hybrid``: the device growth of ``hybrid`` trees gives, for every request of a batch, the tree the
host builder (``tree/best_first.BestFirstBuilder``, what the reference decoder and the plugin grow) gives: same nodes,
same order, same sources, same reaches (bit-equal), same head rounds, with a width bound or without, with a cost
curve that prices head levels and cuts the tree, or without. The head is a stand-in whose candidates depend on the
node's path only (the same on both sides); its small vocabulary makes it propose the context's tokens often, so
nodes that both sources proposed ("both", re-rated) are common, and the estimate tables take few values, so reach
ties (broken by node id) are common too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_spec.device_trees.hybrid import HybridShape, SourceEstimates, build_hybrid_trees, step_prices
from sglang_spec.kernels.ngram_match import ngram_match, ngram_match_reference
from sglang_spec.tree.candidates import Candidates, CandidateSource
from sglang_spec.costs import CostCurve
from sglang_spec.tree.best_first import BestFirstBuilder
from sglang_spec.tree.ngram import NgramIndex
from sglang_spec.tree.policies import TreePolicy
from sglang_spec.tree.profile import SOURCE_LOOKUP, SOURCE_MTP, SourceCounts
from test_device_lookup_tree import batch_inputs, tied_counts
from test_ngram_match import random_history

HASH = 2**31


def path_hash(request: int, path: list[int]) -> int:
    return (request * 7919 + sum((token + 1) * 31 ** (index + 1) for index, token in enumerate(path))) % HASH


def head_scores(hashed: int, vocab: int) -> list[int]:
    return [((hashed * 1103515245 + (token + 1) * 12345) % HASH) * vocab + (vocab - 1 - token)
            for token in range(vocab)]


def head_probs(hashed: int, topk: int) -> list[float]:
    return [float(np.float32(1.0 / (1.2 + rank + (hashed % 5) * 0.37))) for rank in range(topk)]


class StandInHead(CandidateSource):
    """The host side of the stand-in head: candidates from the node's path (below the root) and the request."""

    def __init__(self, request: int, vocab: int) -> None:
        self.request, self.vocab = request, vocab

    def expand(self, tree, node_ids, k: int) -> Candidates:
        tokens, probs = [], []
        for node in node_ids:
            hashed = path_hash(self.request, tree.path_tokens(node)[1:])
            scores = head_scores(hashed, self.vocab)
            tokens.append(sorted(range(self.vocab), key=lambda token: -scores[token])[:k])
            probs.append(head_probs(hashed, min(k, self.vocab)))  # as many as there are tokens
        return Candidates(torch.tensor(tokens, dtype=torch.int64), torch.tensor(probs, dtype=torch.float32))


def device_head(requests: torch.Tensor, vocab: int, topk: int):
    """The device side: the same candidates from the growth's paths, as tensor operations."""
    def expand(level, nodes, growth):
        device = nodes.device
        paths = growth.paths[torch.arange(nodes.shape[0], device=device)[:, None], nodes.clamp(min=0)]  # [R, W, d]
        powers = 31 ** torch.arange(1, paths.shape[-1] + 1, dtype=torch.int64, device=device)  # no host copy
        hashed = (requests.to(device)[:, None] * 7919 + ((paths + 1) * powers).sum(-1)) % HASH  # [R, W]
        tokens = torch.arange(vocab, device=device)
        scores = ((hashed[..., None] * 1103515245 + (tokens + 1) * 12345) % HASH) * vocab + (vocab - 1 - tokens)
        chosen = torch.sort(scores, dim=-1, descending=True).indices[..., :topk]
        ranks = torch.arange(min(topk, vocab), dtype=torch.float64, device=device)
        probs = (1.0 / (1.2 + ranks + (hashed[..., None] % 5).double() * 0.37)).float()
        return chosen, probs
    return expand


def random_counts(rng: np.random.Generator, max_ngram: int) -> SourceCounts:
    """Lookup, head, both and top-1 cells of a few values each (ties everywhere)."""
    counts = tied_counts(rng, max_ngram)
    for cell in [cell for row in counts.mtp for cell in row] + counts.both + counts.mtp_top1:
        cell[1] = float(rng.choice([3, 4, 7]))
        cell[0] = float(rng.integers(0, int(cell[1]) + 1))
    return counts


def random_costs(rng: np.random.Generator) -> CostCurve:
    """A verify cost that grows with the tree and a head level that costs from little to a lot: head levels and
    tree prefixes are priced in and out."""
    base = 0.03
    growth = float(rng.choice([0.0005, 0.002, 0.006]))
    return CostCurve(verify={size: base + growth * size for size in (1, 2, 4, 8, 16, 32)},
                     draft_level=float(rng.choice([0.0005, 0.004, 0.015])), step_overhead=0.001, prefix=100,
                     device="cpu")


def host_build(policy: TreePolicy, history: list[int], counts: SourceCounts, request: int, vocab: int):
    builder = BestFirstBuilder(policy.best_first_shape(), history[-1], NgramIndex(history, policy.max_ngram), counts)
    head = StandInHead(request, vocab)
    rounds = builder.rounds()
    try:
        nodes = next(rounds)
        while True:
            nodes = rounds.send(head.expand(builder.tree, nodes, policy.effective_topk))
    except StopIteration as done:
        return done.value, builder


CASES = [
    # requests, history length, vocabulary, budget, depth, topk, width, mtp levels, lookup width, max_ngram, costs
    (1, 30, 3, 4, 2, 2, None, 1, 2, 4, False),
    (3, 60, 4, 7, 4, 3, 5, 3, 2, 8, False),
    (3, 60, 4, 7, 4, 3, 5, 3, 2, 8, True),
    (4, 120, 3, 15, 5, 4, 6, 2, 3, 8, True),
    (2, 80, 2, 12, 6, 2, 3, 4, 3, 3, False),
    (3, 40, 6, 6, 3, 4, None, 2, 2, 2, True),
    (2, 3, 2, 5, 3, 2, 4, 2, 2, 8, True),
    (3, 50, 3, 9, 1, 3, 4, 2, 2, 4, False),
    # large budgets, deep trees: a lookup growth needs every one of its passes
    (2, 200, 5, 20, 5, 1, None, 3, 1, 1, False),
    (1, 300, 5, 44, 7, 2, None, 1, 3, 5, False),
    # a binding width bound: more distinct candidates than a node may keep
    (2, 80, 6, 5, 5, 2, 1, 3, 2, 1, False),
    (2, 60, 8, 9, 4, 4, 2, 2, 3, 4, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(value) for value in c))
def test_device_trees_are_the_host_builders_trees(case):
    requests, longest, vocab, budget, depth, topk, width, levels, lookup_width, max_ngram, priced = case
    rng = np.random.default_rng(sum(value or 0 for value in case))
    shape = HybridShape(budget=budget, depth=depth, width=width, topk=topk, mtp_levels=levels,
                        lookup_width=lookup_width, max_ngram=max_ngram)
    for attempt in range(4):
        counts = random_counts(rng, max_ngram)
        costs = random_costs(rng) if priced else None
        policy = TreePolicy("hybrid", budget, depth, topk=topk, width=width, mtp_levels=levels,
                            lookup_width=lookup_width, max_ngram=max_ngram, costs=costs)
        histories = [random_history(rng, int(rng.integers(1, longest + 1)), vocab) for _ in range(requests)]
        history, lengths = batch_inputs(histories)
        order = torch.from_numpy(rng.permutation(requests)).long()  # requests need not be in history-row order
        head = device_head(order, vocab, topk)
        root_tokens, root_probs = head(-1, torch.zeros(requests, 1, dtype=torch.int64),
                                       type("Root", (), {"paths": torch.full((requests, 1, depth), -1)})())
        prices = None if costs is None else step_prices(costs, budget + 1 + shape.round_width, shape.head_rounds + 2,
                                                        "cpu")
        trees = build_hybrid_trees(history, lengths, order, root_tokens[:, 0], root_probs[:, 0], head,
                                   SourceEstimates.of(counts, "cpu"), shape, prices)
        for column, row in enumerate(order.tolist()):
            expected, builder = host_build(policy, histories[row], counts, row, vocab)
            count = int(trees.num_nodes[column])
            label = f"attempt {attempt}, request {column}"
            assert count == expected.tree.num_nodes, label
            assert trees.tokens[column, :count].tolist() == expected.tree.tokens.tolist(), label
            assert trees.parents[column, :count].tolist() == expected.tree.parents.tolist(), label
            sources = [(SOURCE_LOOKUP if match else 0) | (SOURCE_MTP if prob >= 0 else 0) for match, prob in
                       zip(trees.match_lengths[column, 1:count].tolist(), trees.mtp_probs[column, 1:count].tolist())]
            assert tuple([0] + sources) == expected.sources, label
            assert trees.estimates[column, :count].tolist() == list(expected.estimates), label
            reach = [1.0] * count
            for node, parent in enumerate(expected.tree.parents.tolist()[1:], start=1):
                reach[node] = reach[parent] * expected.estimates[node]
            assert trees.reach[column, :count].tolist() == reach, label  # exactly: the same float64 products
            assert int(trees.mtp_forwards[column]) == builder.mtp_forwards, label
            assert (trees.tokens[column, count:] == -1).all() and (trees.parents[column, count:] == -1).all()


def test_the_draft_trees_read_back_are_the_host_builders():
    """What the plugin's calibration observes: the host builder's DraftTree, its cells (the same cells of the same
    counts) and estimates included; rows left out read as None."""
    from sglang_spec.device_trees.hybrid import hybrid_draft_trees

    rng = np.random.default_rng(13)
    counts = random_counts(rng, 8)
    histories = [random_history(rng, 60, 3) for _ in range(3)]
    history, lengths = batch_inputs(histories)
    rows = torch.arange(3)
    shape = HybridShape(budget=9, depth=4, width=5, topk=3, mtp_levels=2, lookup_width=2, max_ngram=8)
    policy = TreePolicy("hybrid", 9, 4, topk=3, width=5, mtp_levels=2, lookup_width=2, max_ngram=8)
    head = device_head(rows, 3, 3)
    root_tokens, root_probs = head(-1, torch.zeros(3, 1, dtype=torch.int64),
                                   type("Root", (), {"paths": torch.full((3, 1, 4), -1)})())
    trees = build_hybrid_trees(history, lengths, rows, root_tokens[:, 0], root_probs[:, 0], head,
                               SourceEstimates.of(counts, "cpu"), shape)
    drafts = hybrid_draft_trees(trees, counts, [True, False, True])
    assert drafts[1] is None
    for row in (0, 2):
        draft, (expected, _) = drafts[row], host_build(policy, histories[row], counts, row, 3)
        assert draft is not None
        assert draft.tree.parents.tolist() == expected.tree.parents.tolist()
        assert draft.tree.tokens.tolist() == expected.tree.tokens.tolist()
        assert draft.sources == expected.sources and draft.estimates == expected.estimates
        assert draft.mtp_forwards == expected.mtp_forwards
        assert [len(cells) for cells in draft.cells] == [len(cells) for cells in expected.cells]
        assert all(a is b for ours, theirs in zip(draft.cells, expected.cells) for a, b in zip(ours, theirs))
        assert draft.expected_accept_length == pytest.approx(expected.expected_accept_length, abs=1e-12)


def test_both_sources_and_priced_out_levels_occur_in_these_cases():
    """The comparison above covers what makes hybrid growth hard: merged ("both") nodes, head levels priced out,
    and trees cut short by the cost curve (counted over the host's trees of a priced case)."""
    rng = np.random.default_rng(3)
    both = priced_out = cut = 0
    for request in range(12):
        counts = random_counts(rng, 8)
        policy = TreePolicy("hybrid", 7, 4, topk=3, width=5, mtp_levels=3, lookup_width=2, max_ngram=8,
                            costs=random_costs(rng))
        history = random_history(rng, 60, 4)
        tree, builder = host_build(policy, history, counts, request, 4)
        both += sum(source == SOURCE_LOOKUP | SOURCE_MTP for source in tree.sources)
        priced_out += builder.priced_out
        cut += tree.tree.num_nodes < 8
    assert both > 0 and priced_out > 0 and cut > 0, (both, priced_out, cut)


def test_the_kernel_grows_the_reference_trees(kernel_device):
    rng = np.random.default_rng(9)
    counts = random_counts(rng, 8)
    histories = [random_history(rng, 50, 3) for _ in range(3)]
    history, lengths = batch_inputs(histories)
    rows = torch.tensor([2, 0, 1])
    shape = HybridShape(budget=7, depth=4, width=5, topk=3, mtp_levels=2, lookup_width=2, max_ngram=8)
    head = device_head(rows, 3, 3)
    root_tokens, root_probs = head(-1, torch.zeros(3, 1, dtype=torch.int64),
                                   type("Root", (), {"paths": torch.full((3, 1, 4), -1)})())

    expected = build_hybrid_trees(history, lengths, rows, root_tokens[:, 0], root_probs[:, 0], head,
                                  SourceEstimates.of(counts, "cpu"), shape, match=ngram_match_reference)
    actual = build_hybrid_trees(history.to(kernel_device), lengths.to(kernel_device), rows.to(kernel_device),
                                root_tokens[:, 0].to(kernel_device), root_probs[:, 0].to(kernel_device),
                                head, SourceEstimates.of(counts, kernel_device), shape, match=ngram_match)
    for name in ("tokens", "parents", "match_lengths", "lookup_ranks", "mtp_probs", "mtp_ranks", "reach",
                 "num_nodes", "mtp_forwards"):
        assert torch.equal(getattr(actual, name).cpu(), getattr(expected, name)), name


def test_the_growth_reads_nothing_on_the_host():
    """Every tensor on the meta device (no data: any host read raises): the growth runs to its result, head rounds,
    pricing and all, so nothing in it waits for the device."""
    meta = torch.device("meta")
    requests, topk = 3, 3
    shape = HybridShape(budget=7, depth=4, width=5, topk=topk, mtp_levels=2, lookup_width=2, max_ngram=8)
    calls = []

    def head(level, nodes, growth):
        calls.append(level)
        assert nodes.device == meta and growth.paths.device == meta
        return (torch.empty(requests, nodes.shape[1], topk, dtype=torch.int64, device=meta),
                torch.empty(requests, nodes.shape[1], topk, dtype=torch.float32, device=meta))

    costs = random_costs(np.random.default_rng(0))
    trees = build_hybrid_trees(torch.empty(3, 40, dtype=torch.int64, device=meta),
                               torch.empty(3, dtype=torch.int64, device=meta),
                               torch.empty(requests, dtype=torch.int64, device=meta),
                               torch.empty(requests, topk, dtype=torch.int64, device=meta),
                               torch.empty(requests, topk, dtype=torch.float32, device=meta), head,
                               SourceEstimates.of(SourceCounts.generic(8), meta), shape,
                               step_prices(costs, 8 + shape.round_width, shape.head_rounds + 2, meta))
    assert calls == [0, 1] and trees.tokens.shape == (requests, 8) and trees.tokens.device == meta
    with pytest.raises(NotImplementedError):
        trees.num_nodes.tolist()  # meta indeed: a read would have raised inside the growth


@pytest.mark.gpu
def test_the_growth_makes_no_host_sync_on_a_gpu():
    """The growth with the Triton kernel and a device head stand-in, priced, under torch's sync debug mode set to
    raise: no host sync anywhere in it; and the trees are the CPU reference's."""
    rng = np.random.default_rng(21)
    counts = random_counts(rng, 8)
    history, lengths = batch_inputs([random_history(rng, 300, 4) for _ in range(4)])
    rows = torch.arange(4)
    shape = HybridShape(budget=11, depth=5, width=6, topk=4, mtp_levels=3, lookup_width=2, max_ngram=8)
    head = device_head(rows, 4, 4)
    costs = random_costs(rng)
    root = type("Root", (), {"paths": torch.full((4, 1, 5), -1)})()
    root_tokens, root_probs = head(-1, torch.zeros(4, 1, dtype=torch.int64), root)

    def inputs(device):
        """Everything the growth reads, on ``device``: copied there before the sync check (a host-to-device copy
        of pageable memory synchronizes), as a server keeps them there."""
        return (history.to(device), lengths.to(device), rows.to(device), root_tokens[:, 0].to(device),
                root_probs[:, 0].to(device), device_head(rows.to(device), 4, 4), SourceEstimates.of(counts, device),
                shape, step_prices(costs, 12 + shape.round_width, shape.head_rounds + 2, device))

    expected = build_hybrid_trees(*inputs("cpu"), ngram_match_reference)
    on_gpu = inputs("cuda")
    build_hybrid_trees(*on_gpu, ngram_match)  # compiles the kernel
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        actual = build_hybrid_trees(*on_gpu, ngram_match)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name in ("tokens", "parents", "reach", "num_nodes", "mtp_forwards"):
        assert torch.equal(getattr(actual, name).cpu(), getattr(expected, name)), name
