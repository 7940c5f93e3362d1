"""Context lookup: an n-gram index over a growing token sequence (prompt + generated tokens), the candidate source
prompt-lookup decoding uses, kept incrementally so a tree builder can ask it about any node.

For every n = 1..max_ngram the index maps each n-gram of the sequence to the positions where it ends, in
increasing order. Appending a token adds one entry per n (O(max_ngram) per token). A query is a *tail* of draft
tokens that would follow the sequence (a tree node's path below the root; empty for the root): the longest
n-gram ending the sequence + tail that also occurs earlier in the sequence with a following token gives the
candidates, one per distinct following token, ranked by how often it followed (then by how recently). The
match length n is what the acceptance of a candidate is calibrated by (``tree/best_first.py``): a longer match is a
stronger copy signal. Matches longer than ``max_ngram`` count as ``max_ngram``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from sglang_spec.errors import SpecError

DEFAULT_MAX_NGRAM = 8
# a query reads at most this many of the most recent occurrences of the matched n-gram (bounds the cost of
# frequent short n-grams such as a lone space token)
MAX_OCCURRENCES = 64


@dataclass(frozen=True)
class LookupCandidate:
    """One candidate next token.

    token:        the token that followed the matched n-gram.
    match_length: n, the length of the longest n-gram ending the query that occurs earlier (1..max_ngram).
    rank:         0-based rank among the distinct tokens that followed that n-gram (most frequent first, then
                  most recent).
    count:        how often it followed (among the occurrences read).
    position:     index in the sequence of its most recent occurrence (the copied token itself).
    """

    token: int
    match_length: int
    rank: int
    count: int
    position: int


class NgramIndex:
    """n-gram positions of a growing token sequence (n = 1..max_ngram)."""

    def __init__(self, tokens: Iterable[int] = (), max_ngram: int = DEFAULT_MAX_NGRAM) -> None:
        if not isinstance(max_ngram, int) or max_ngram < 1:
            raise SpecError(f"max_ngram must be an integer >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        tokens = self.tokens
        tokens.append(int(token))
        end = len(tokens) - 1
        for n in range(1, min(self.max_ngram, len(tokens)) + 1):
            key = tuple(tokens[end - n + 1 :])
            positions = self._ends.get(key)
            if positions is None:
                self._ends[key] = [end]
            else:
                positions.append(end)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def continuations(self, tail: Sequence[int] = (), max_candidates: int = 4) -> list[LookupCandidate]:
        """Candidates for the token after ``self.tokens + tail``, best first; [] when no n-gram matches."""
        tokens = self.tokens
        length = len(tokens)
        longest = min(self.max_ngram, length + len(tail))
        for n in range(longest, 0, -1):
            key = _last(tokens, tail, n)
            positions = self._ends.get(key)
            if not positions:
                continue
            # occurrences that have a following token in the sequence (the newest may end the sequence itself)
            stop = len(positions) - 1 if positions[-1] == length - 1 else len(positions)
            if stop == 0:
                continue
            counts: dict[int, int] = {}
            latest: dict[int, int] = {}
            for index in range(stop - 1, max(stop - 1 - MAX_OCCURRENCES, -1), -1):
                position = positions[index] + 1
                token = tokens[position]
                if token in counts:
                    counts[token] += 1
                else:
                    counts[token] = 1
                    latest[token] = position
            order = sorted(counts, key=lambda token: (-counts[token], -latest[token]))
            return [
                LookupCandidate(token, n, rank, counts[token], latest[token])
                for rank, token in enumerate(order[:max_candidates])
            ]
        return []


def _last(tokens: list[int], tail: Sequence[int], n: int) -> tuple[int, ...]:
    """The last n tokens of tokens + tail (n <= len(tokens) + len(tail))."""
    if n <= len(tail):
        return tuple(tail[len(tail) - n :])
    return tuple(tokens[len(tokens) - (n - len(tail)) :]) + tuple(tail)
