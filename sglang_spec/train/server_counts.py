"""A tree server's acceptance counters, read from its ``/metrics`` page (Prometheus text; ``sglang_plugin/metrics.py``
writes them): the per-(depth, rank) table (``parse_rank_counts``, ``rank_rows``: Sequoia's profile), the per-source
counts of lookup / hybrid trees (``parse_source_counts``) and the per-head accept counts of a server whose head is
swapped in place (``parse_head_counts``). What ``sglang-spec calibrate --from-server`` and ``sglang-spec adapt``
read. No HTTP here: callers fetch the page.
"""

from __future__ import annotations

import math
import re
from typing import Iterator

from sglang_spec.errors import SpecError

RANK_COUNTERS = ("sglang_spec_tree_rank_offered_total", "sglang_spec_tree_rank_accepted_total")
STEPS_COUNTER = "sglang_spec_tree_rank_steps_total"
SOURCE_COUNTERS = ("sglang_spec_source_accepted_total", "sglang_spec_source_offered_total")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


LAUNCH_HEAD = "0"  # the head label of a server's launch head, before any swap (its /metrics and answers)
HEAD_COUNTERS = ("sglang_spec_head_verify_steps_total", "sglang_spec_head_accepted_drafts_total")


def _samples(text: str, names: tuple[str, ...]) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample of the counters ``names`` in Prometheus text whose value is a finite
    number (a process's line each: callers sum them)."""
    for line in text.splitlines():
        match = _SAMPLE.match(line) if line.startswith("sglang_spec_") else None
        if match is None or match.group(1) not in names:
            continue
        try:
            number = float(match.group(3))
        except ValueError:
            continue
        if math.isfinite(number):
            yield match.group(1), dict(_LABEL.findall(match.group(2) or "")), number


def parse_rank_counts(text: str, url: str = "server") -> tuple[int, dict, dict]:
    """(steps, offered, accepted) from Prometheus text: offered / accepted map (depth, rank) to counts. Counters
    of the same labels from several processes are summed."""
    if not any(line.startswith("sglang_spec_") for line in text.splitlines()):
        raise SpecError(f"{url}/metrics has no sglang_spec counters: the server does not run the sglang_spec "
                        "plugin with a tree policy (--speculative-tree-policy)")
    steps = 0.0
    tables: tuple[dict, dict] = ({}, {})
    for name, labels, number in _samples(text, (STEPS_COUNTER, *RANK_COUNTERS)):
        if name == STEPS_COUNTER:
            steps += number
            continue
        try:
            key = (int(labels["depth"]), int(labels["rank"]))
        except (KeyError, ValueError):
            continue
        table = tables[RANK_COUNTERS.index(name)]
        table[key] = table.get(key, 0.0) + number
    if steps <= 0:
        raise SpecError(f"{url}: no per-rank counts yet (the tree counters count verify steps on attention-TP "
                        "rank 0 with --enable-metrics); send requests first")
    return int(steps), tables[0], tables[1]


def parse_source_counts(text: str) -> dict[str, tuple[float, float]]:
    """Cell name -> (accepted, offered) from the per-source counters a lookup / hybrid server exports (summed
    over processes); empty when it serves neither."""
    tables: tuple[dict, dict] = ({}, {})
    for name, labels, number in _samples(text, SOURCE_COUNTERS):
        cell = labels.get("cell")
        if cell:
            table = tables[SOURCE_COUNTERS.index(name)]
            table[cell] = table.get(cell, 0.0) + number
    accepted, offered = tables
    return {cell: (min(accepted.get(cell, 0.0), count), count) for cell, count in offered.items() if count > 0}


def rank_rows(offered: dict, accepted: dict, max_depth: int,
              max_rank: int) -> tuple[list[tuple[float, ...]], list[int]]:
    """rank_acceptance rows: accepted / offered per depth 1, 2, ... and rank; a depth with no offers ends the table.
    A rank never offered at a depth gets 0; a row whose estimates sum past 1 (ranks offered unequally often) is
    scaled to sum 1. Also the nodes offered per depth."""
    rows, counted = [], []
    for depth in range(1, max_depth + 1):
        total = sum(count for (d, _), count in offered.items() if d == depth)
        if total <= 0:
            break
        width = min(max_rank, 1 + max(r for (d, r), count in offered.items() if d == depth and count > 0))
        row = [accepted.get((depth, rank), 0.0) / offered[(depth, rank)] if offered.get((depth, rank), 0) > 0
               else 0.0 for rank in range(width)]
        row = [min(1.0, value) for value in row]
        if math.fsum(row) > 1:
            row = [value / math.fsum(row) for value in row]
        rows.append(tuple(row))
        counted.append(int(total))
    return rows, counted


def parse_head_counts(text: str) -> dict[str, tuple[int, int]]:
    """Per head label, (verify steps, accepted drafts) drafted with it (summed over processes)."""
    counts: dict[str, list[float]] = {}
    for name, labels, number in _samples(text, HEAD_COUNTERS):
        head = labels.get("head")
        if head is not None:
            counts.setdefault(head, [0.0, 0.0])[HEAD_COUNTERS.index(name)] += number
    return {head: (int(steps), int(accepted)) for head, (steps, accepted) in counts.items()}


def subtract_counts(now: dict, before: dict) -> dict:
    """Counter tables (key -> count) as counted since ``before``."""
    return {key: count - before.get(key, 0.0) for key, count in now.items() if count - before.get(key, 0.0) > 0}
