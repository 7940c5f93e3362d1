"""``kernels.ngram_match``: the device context lookup answers exactly what ``tree/ngram.NgramIndex`` answers (the
host index the tree builders read), and the Triton kernel exactly what its torch reference answers.

Histories are drawn from small vocabularies with copied spans, so long n-gram matches, repeated continuations
(counts above one), ties broken by recency and more than ``MAX_OCCURRENCES`` occurrences all happen."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_spec.kernels.ngram_match import NgramMatches, ngram_match, ngram_match_reference
from sglang_spec.tree.ngram import MAX_OCCURRENCES, NgramIndex


def random_history(rng: np.random.Generator, length: int, vocab: int) -> list[int]:
    """Tokens with spans copied from earlier in the sequence (what a context lookup finds)."""
    tokens: list[int] = []
    while len(tokens) < length:
        if len(tokens) > 8 and rng.random() < 0.4:
            start = int(rng.integers(0, len(tokens) - 4))
            tokens += tokens[start:start + int(rng.integers(2, 9))]
        else:
            tokens.append(int(rng.integers(vocab)))
    return tokens[:length]


def queries_for(rng: np.random.Generator, histories: list[list[int]], count: int, max_tail: int, vocab: int):
    """(rows, tails): each query a history row and a tail, often copied from the history so it matches."""
    rows, tails = [], []
    for _ in range(count):
        row = int(rng.integers(len(histories)))
        history = histories[row]
        size = int(rng.integers(0, max_tail + 1))
        if history and rng.random() < 0.6:
            start = int(rng.integers(0, len(history)))
            tail = history[start:start + size]
        else:
            tail = [int(token) for token in rng.integers(vocab, size=size)]
        rows.append(row)
        tails.append(tail)
    return rows, tails


def as_tensors(histories: list[list[int]], rows: list[int], tails: list[list[int]]) -> dict[str, torch.Tensor]:
    span = max([len(history) for history in histories] + [1])
    width = max([len(tail) for tail in tails] + [0])
    history = torch.full((len(histories), span + 3), -7, dtype=torch.int64)  # junk past each row's length
    for index, tokens in enumerate(histories):
        history[index, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    tail_tensor = torch.full((len(tails), width), -7, dtype=torch.int64)
    for index, tail in enumerate(tails):
        tail_tensor[index, :len(tail)] = torch.tensor(tail, dtype=torch.int64)
    return {"history": history, "lengths": torch.tensor([len(h) for h in histories], dtype=torch.int64),
            "query_rows": torch.tensor(rows, dtype=torch.int64), "tails": tail_tensor,
            "tail_lengths": torch.tensor([len(t) for t in tails], dtype=torch.int64)}


def index_answer(histories, rows, tails, max_ngram: int, width: int) -> NgramMatches:
    """NgramIndex.continuations for every query, in NgramMatches' layout."""
    result = NgramMatches.empty(len(rows), width, "cpu")
    indexes = [NgramIndex(history, max_ngram=max_ngram) for history in histories]
    for query, (row, tail) in enumerate(zip(rows, tails)):
        candidates = indexes[row].continuations(tail, width)
        for rank, candidate in enumerate(candidates):
            assert candidate.rank == rank and candidate.match_length == candidates[0].match_length
            result.tokens[query, rank] = candidate.token
            result.counts[query, rank] = candidate.count
            result.positions[query, rank] = candidate.position
        result.match_lengths[query] = candidates[0].match_length if candidates else 0
    return result


def assert_same(actual: NgramMatches, expected: NgramMatches) -> None:
    for name in ("tokens", "counts", "positions", "match_lengths"):
        assert torch.equal(getattr(actual, name).cpu(), getattr(expected, name)), name


CASES = [
    # histories, longest history, vocabulary, queries, longest tail, max_ngram, width
    (1, 1, 3, 2, 0, 8, 4),
    (2, 2, 2, 4, 2, 3, 1),
    (3, 40, 3, 12, 4, 8, 4),
    (4, 150, 5, 16, 6, 4, 2),
    (2, 300, 2, 8, 3, 8, 4),  # a two-token vocabulary: far more than MAX_OCCURRENCES occurrences
    (5, 90, 30, 20, 5, 1, 3),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"r{c[0]}l{c[1]}v{c[2]}q{c[3]}n{c[5]}w{c[6]}")
def test_the_reference_answers_what_the_host_index_answers(case):
    count, longest, vocab, queries, max_tail, max_ngram, width = case
    rng = np.random.default_rng(sum(case))
    for _ in range(3):
        histories = [random_history(rng, int(rng.integers(0, longest + 1)), vocab) for _ in range(count)]
        rows, tails = queries_for(rng, histories, queries, max_tail, vocab)
        expected = index_answer(histories, rows, tails, max_ngram, width)
        assert_same(ngram_match_reference(**as_tensors(histories, rows, tails), max_ngram=max_ngram, width=width),
                    expected)


@pytest.mark.parametrize("case", CASES[:5], ids=lambda c: f"r{c[0]}l{c[1]}v{c[2]}q{c[3]}n{c[5]}w{c[6]}")
def test_the_kernel_answers_what_the_reference_answers(kernel_device, case):
    count, longest, vocab, queries, max_tail, max_ngram, width = case
    rng = np.random.default_rng(1000 + sum(case))
    histories = [random_history(rng, int(rng.integers(0, longest + 1)), vocab) for _ in range(count)]
    rows, tails = queries_for(rng, histories, queries, max_tail, vocab)
    inputs = as_tensors(histories, rows, tails)
    expected = ngram_match_reference(**inputs, max_ngram=max_ngram, width=width)
    out = NgramMatches.empty(queries, width, kernel_device)
    result = ngram_match(**{name: tensor.to(kernel_device) for name, tensor in inputs.items()},
                         max_ngram=max_ngram, width=width, out=out)
    assert result is out
    assert_same(result, expected)


def test_a_worked_example():
    """History "a b c a b d a b" (a=1, b=2, c=3, d=4) and the root's query: "a b" ends it and ends earlier at 1
    (followed by c) and 4 (followed by d): n* = 2, d first (as frequent, more recent), then c."""
    inputs = as_tensors([[1, 2, 3, 1, 2, 4, 1, 2]], [0, 0], [[], [3]])
    result = ngram_match_reference(**inputs, max_ngram=4, width=3)
    assert result.tokens.tolist() == [[4, 3, -1], [1, -1, -1]]
    assert result.positions.tolist() == [[5, 2, -1], [3, -1, -1]]
    assert result.counts.tolist() == [[1, 1, 0], [1, 0, 0]]
    assert result.match_lengths.tolist() == [2, 3]  # the tail "c" extends "a b" into "a b c"


def test_bad_shapes_are_one_clear_error():
    inputs = as_tensors([[1, 2, 1]], [0], [[]])
    with pytest.raises(ValueError, match="lengths must be"):
        ngram_match_reference(**{**inputs, "lengths": torch.tensor([3, 3])}, max_ngram=2, width=2)
    with pytest.raises(ValueError, match="width in 1"):
        ngram_match_reference(**inputs, max_ngram=2, width=MAX_OCCURRENCES + 1)


def test_strided_inputs_answer_what_contiguous_ones_answer(kernel_device):
    """Views as the growths pass them: a batch of one request queries through ``expand`` (query rows of stride 0),
    the history is a column window of a wider buffer, tails and tail lengths are strided slices. The kernel reads
    them as the reference reads their contiguous copies (on a GPU it read past the one-element row tensor, an
    illegal address at 127 queries, before its launcher made them contiguous)."""
    rng = np.random.default_rng(77)
    histories = [random_history(rng, 60, 4) for _ in range(3)]
    queries, max_ngram, width = 70, 6, 3
    rows, tails = queries_for(rng, histories, queries, 4, 4)
    rows = [2] * queries
    inputs = as_tensors(histories, rows, tails)
    expected = ngram_match_reference(**inputs, max_ngram=max_ngram, width=width)
    wide = torch.full((3, inputs["history"].shape[1] + 9), -5, dtype=torch.int64)
    wide[:, 4:4 + inputs["history"].shape[1]] = inputs["history"]
    wide_tails = torch.full((queries, inputs["tails"].shape[1] + 3), -5, dtype=torch.int64)
    wide_tails[:, :inputs["tails"].shape[1]] = inputs["tails"]
    spaced_lengths = torch.stack([inputs["tail_lengths"], torch.zeros_like(inputs["tail_lengths"])], dim=1)
    device = kernel_device
    strided = {"history": wide.to(device)[:, 4:4 + inputs["history"].shape[1]],
               "lengths": inputs["lengths"].to(device),
               "query_rows": torch.tensor([2], device=device).expand(queries),
               "tails": wide_tails.to(device)[:, :inputs["tails"].shape[1]],
               "tail_lengths": spaced_lengths.to(device)[:, 0]}
    assert strided["query_rows"].stride(0) == 0 and not strided["tails"].is_contiguous()
    assert not strided["tail_lengths"].is_contiguous() and strided["history"].stride(0) != strided["history"].shape[1]
    assert_same(ngram_match(**strided, max_ngram=max_ngram, width=width), expected)
    transposed = inputs["history"].t().contiguous().t()
    with pytest.raises(ValueError, match="history's rows must be contiguous"):
        ngram_match(**{**inputs, "history": transposed}, max_ngram=max_ngram, width=width)
