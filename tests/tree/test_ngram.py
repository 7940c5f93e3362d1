"""The context n-gram index: incremental updates give the same candidates as a brute-force scan of the whole
sequence, for random sequences over small alphabets (many repeats) and random draft tails."""

import numpy as np
import pytest

from sglang_spec.errors import SpecError
from sglang_spec.tree.ngram import MAX_OCCURRENCES, LookupCandidate, NgramIndex


def brute_force(tokens, tail, max_ngram, max_candidates):
    """Scan every earlier occurrence of the longest matching n-gram (n <= max_ngram) of tokens + tail."""
    query = list(tokens) + list(tail)
    for n in range(min(max_ngram, len(query)), 0, -1):
        key = query[len(query) - n :]
        ends = [end for end in range(n - 1, len(tokens) - 1) if tokens[end - n + 1 : end + 1] == key]
        ends = ends[-MAX_OCCURRENCES:]
        if not ends:
            continue
        counts, latest = {}, {}
        for end in ends:
            token = tokens[end + 1]
            counts[token] = counts.get(token, 0) + 1
            latest[token] = max(latest.get(token, -1), end + 1)
        order = sorted(counts, key=lambda t: (-counts[t], -latest[t]))[:max_candidates]
        return [LookupCandidate(t, n, rank, counts[t], latest[t]) for rank, t in enumerate(order)]
    return []


@pytest.mark.parametrize("alphabet", [2, 3, 7, 50])
@pytest.mark.parametrize("max_ngram", [1, 3, 8])
def test_incremental_index_matches_brute_force(alphabet, max_ngram):
    rng = np.random.default_rng(alphabet * 100 + max_ngram)
    index = NgramIndex(max_ngram=max_ngram)
    tokens = []
    for step in range(160):
        chunk = rng.integers(alphabet, size=int(rng.integers(1, 4))).tolist()
        if step % 2:
            index.extend(chunk)
        else:
            for token in chunk:
                index.append(token)
        tokens += chunk
        assert index.tokens == tokens and len(index) == len(tokens)
        for _ in range(3):
            tail = rng.integers(alphabet, size=int(rng.integers(0, 5))).tolist()
            width = int(rng.integers(1, 5))
            assert index.continuations(tail, width) == brute_force(tokens, tail, max_ngram, width), (tokens, tail)


def test_prompt_lookup_example():
    """What a prompt-lookup drafter copies: "b c" was followed by d twice and by e once."""
    a, b, c, d, e, x, y, z = range(1, 9)
    index = NgramIndex([a, b, c, d, x, b, c, e, z, b, c, d, y, b, c])
    best, second = index.continuations([], 4)
    assert (best.token, best.match_length, best.count, best.position) == (d, 2, 2, 11)
    assert (second.token, second.rank, second.count) == (e, 1, 1)
    # a draft tail extends the query below the root: "b c" + [d] matches "b c d", followed by x and by y (newer)
    assert [candidate.token for candidate in index.continuations([d], 2)] == [y, x]
    assert index.continuations([d], 2)[0].match_length == 3
    assert index.continuations([99], 2) == []  # never seen
    assert NgramIndex([5]).continuations() == []  # the only occurrence ends the sequence


def test_occurrences_read_are_bounded():
    index = NgramIndex([1] * 1000, max_ngram=1)
    (candidate,) = index.continuations([], 4)
    assert candidate.count == MAX_OCCURRENCES and candidate.position == 999


def test_bad_max_ngram():
    with pytest.raises(SpecError, match="max_ngram must be an integer >= 1"):
        NgramIndex(max_ngram=0)
