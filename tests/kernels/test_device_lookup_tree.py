"""``device_trees/lookup``: the device growth of ``lookup`` trees gives, for every request of a batch, the tree the
host builder (``tree/best_first.BestFirstBuilder``, what the reference decoder and the plugin grow) gives: same
nodes, same order, same reaches. Estimates are drawn from a few values, so reach ties (broken by node id) are
common, and histories copy spans, so trees branch and run deep."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_spec.device_trees.lookup import build_lookup_trees, lookup_estimates
from sglang_spec.kernels.ngram_match import ngram_match, ngram_match_reference
from sglang_spec.tree.proposal import DraftSources
from sglang_spec.tree.best_first import build_best_first
from sglang_spec.tree.ngram import NgramIndex
from sglang_spec.tree.policies import TreePolicy
from sglang_spec.tree.profile import SourceCounts
from test_ngram_match import random_history


def tied_counts(rng: np.random.Generator, max_ngram: int) -> SourceCounts:
    """A counts table whose lookup estimates take a few values (ties everywhere), zero included."""
    counts = SourceCounts.generic(max_ngram)
    for row in counts.lookup:
        for cell in row:
            cell[1] = float(rng.choice([3, 4, 7]))
            cell[0] = float(rng.integers(0, int(cell[1]) + 1))
    return counts


def batch_inputs(histories: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    span = max(len(history) for history in histories)
    history = torch.full((len(histories), span + 2), -5, dtype=torch.int64)
    for row, tokens in enumerate(histories):
        history[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    return history, torch.tensor([len(tokens) for tokens in histories], dtype=torch.int64)


def host_tree(policy: TreePolicy, history: list[int], counts: SourceCounts):
    draft = build_best_first(policy.best_first_shape(), history[-1],
                             DraftSources(context=NgramIndex(history, policy.max_ngram)), counts)
    return draft


CASES = [
    # requests, history length, vocabulary, budget, depth, lookup width, max_ngram
    (1, 30, 3, 4, 2, 2, 4),
    (3, 60, 4, 7, 4, 2, 8),
    (4, 120, 3, 15, 5, 4, 8),
    (2, 80, 2, 12, 6, 3, 3),
    (3, 40, 20, 6, 1, 2, 2),
    (2, 3, 2, 5, 3, 2, 8),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"r{c[0]}l{c[1]}v{c[2]}b{c[3]}d{c[4]}w{c[5]}n{c[6]}")
def test_device_trees_are_the_host_builders_trees(case):
    requests, longest, vocab, budget, depth, width, max_ngram = case
    rng = np.random.default_rng(sum(case))
    policy = TreePolicy("lookup", budget, depth, lookup_width=width, max_ngram=max_ngram)
    for _ in range(4):
        counts = tied_counts(rng, max_ngram)
        histories = [random_history(rng, int(rng.integers(1, longest + 1)), vocab) for _ in range(requests)]
        history, lengths = batch_inputs(histories)
        order = torch.from_numpy(rng.permutation(requests)).long()  # requests need not be in history-row order
        trees = build_lookup_trees(history, lengths, order, lookup_estimates(counts, "cpu"), budget, depth, width)
        for column, row in enumerate(order.tolist()):
            expected = host_tree(policy, histories[row], counts)
            count = int(trees.num_nodes[column])
            assert count == expected.tree.num_nodes
            assert trees.tokens[column, :count].tolist() == expected.tree.tokens.tolist()
            assert trees.parents[column, :count].tolist() == expected.tree.parents.tolist()
            reach = [1.0] * count
            for node, parent in enumerate(expected.tree.parents.tolist()[1:], start=1):
                reach[node] = reach[parent] * expected.estimates[node]
            assert trees.reach[column, :count].tolist() == reach  # exactly: the same float64 products
            assert (trees.tokens[column, count:] == -1).all() and (trees.parents[column, count:] == -1).all()


def test_the_kernel_grows_the_reference_trees(kernel_device):
    rng = np.random.default_rng(7)
    counts = tied_counts(rng, 8)
    histories = [random_history(rng, 50, 3) for _ in range(3)]
    history, lengths = batch_inputs(histories)
    rows = torch.tensor([2, 0, 1])
    estimates = lookup_estimates(counts, "cpu")
    expected = build_lookup_trees(history, lengths, rows, estimates, 7, 4, 2)
    actual = build_lookup_trees(history.to(kernel_device), lengths.to(kernel_device), rows.to(kernel_device),
                                estimates.to(kernel_device), 7, 4, 2, match=ngram_match)
    for name in ("tokens", "parents", "match_lengths", "ranks", "reach", "num_nodes"):
        assert torch.equal(getattr(actual, name).cpu(), getattr(expected, name)), name


def test_a_context_without_repeats_gives_the_root_alone():
    history, lengths = batch_inputs([[1, 2, 3, 4, 5]])
    trees = build_lookup_trees(history, lengths, torch.tensor([0]), lookup_estimates(SourceCounts.generic(8), "cpu"),
                               4, 3, 2, match=ngram_match_reference)
    assert trees.num_nodes.tolist() == [1] and trees.tokens[0].tolist() == [5, -1, -1, -1, -1]


def test_the_draft_trees_read_back_are_the_host_builders():
    """What the plugin's calibration observes: the host builder's DraftTree, cells and estimates included."""
    from sglang_spec.device_trees.lookup import lookup_draft_trees

    rng = np.random.default_rng(11)
    counts = tied_counts(rng, 8)
    histories = [random_history(rng, 60, 3) for _ in range(3)]
    history, lengths = batch_inputs(histories)
    trees = build_lookup_trees(history, lengths, torch.arange(3), lookup_estimates(counts, "cpu"), 9, 4, 2)
    policy = TreePolicy("lookup", 9, 4, lookup_width=2, max_ngram=8)
    for row, draft in enumerate(lookup_draft_trees(trees, counts)):
        expected = host_tree(policy, histories[row], counts)
        assert draft.tree.parents.tolist() == expected.tree.parents.tolist()
        assert draft.tree.tokens.tolist() == expected.tree.tokens.tolist()
        assert draft.sources == expected.sources and draft.estimates == expected.estimates
        assert all(a is b for ours, theirs in zip(draft.cells, expected.cells) for a, b in zip(ours, theirs))
        assert len(draft.cells) == len(expected.cells)
        assert draft.expected_accept_length == pytest.approx(expected.expected_accept_length, abs=1e-12)


@pytest.mark.gpu
def test_the_device_draft_makes_no_host_sync_on_a_gpu():
    """What a ``lookup`` server's draft step runs on the device (growth with the Triton kernel, padding, encoding)
    under torch's sync debug mode set to raise: no host sync anywhere in it."""
    from sglang_spec.sglang_plugin.drafters.padding import pad_to_budget_device
    from sglang_spec.tree.encode_sglang import encode_sglang_draft_device

    rng = np.random.default_rng(5)
    history, lengths = batch_inputs([random_history(rng, 300, 4) for _ in range(4)])
    history, lengths = history.cuda(), lengths.cuda()
    rows, estimates = torch.arange(4, device="cuda"), lookup_estimates(SourceCounts.generic(8), "cuda")

    def draft():
        trees = build_lookup_trees(history, lengths, rows, estimates, 11, 5, 2, match=ngram_match)
        parents, tokens = pad_to_budget_device(trees.parents, trees.tokens, trees.num_nodes, 11, 3, 5)
        return encode_sglang_draft_device(parents, tokens, 3, 5)

    expected = draft()  # compiles the kernel
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        encoded = draft()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(a, b) for a, b in zip(encoded, expected))
