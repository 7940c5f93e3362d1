"""Hardware-aware tree size: the (budget, depth) whose expected accept length buys the most time per token.

Sequoia's rule (arXiv 2402.12374 §4.2, ``tree_search.py``): for a tree with n = budget + 1 nodes and L = depth + 1
levels, one step costs ``L * draft_time + verify_time(n)`` and yields ``R[n, L]`` tokens in expectation, so the time
per token is their ratio; speedup = ``verify_time(1) / time per token``. Plain decoding (no speculation, no draft
pass) costs ``verify_time(1)`` per token and is a candidate too, so the choice is never predicted slower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from sglang_spec.errors import SpecError
from sglang_spec.tree.profile import AcceptanceProfile
from sglang_spec.tree.sequoia import sequoia_table


@dataclass(frozen=True)
class TreeSizeChoice:
    """budget = 0 means "do not speculate". ``expected_accept_length`` includes the bonus token."""

    budget: int
    depth: int
    expected_accept_length: float
    time_per_token: float
    speedup: float


def choose_tree_size(
    profile: AcceptanceProfile,
    verify_times: Mapping[int, float],
    draft_time: float,
    max_depth: int,
    budgets: Sequence[int] | None = None,
    allow_no_speculation: bool = True,
    max_branch: int | None = None,
) -> TreeSizeChoice:
    """Best Sequoia tree size under a measured cost table.

    verify_times: target forward time for ``k`` tree tokens (root included), keyed by k; must contain 1.
    draft_time: time of one draft pass (one tree level), in the same unit.
    budgets: candidate draft-node budgets (default: every key of verify_times minus one, except 0).
    Ties keep the first candidate in (budget, depth) order, as Sequoia's strict ``<`` does.
    """
    if 1 not in verify_times:
        raise SpecError("verify_times must include the one-token (plain decoding) time, key 1")
    if any(t <= 0 for t in verify_times.values()) or draft_time < 0:
        raise SpecError("verify and draft times must be positive")
    candidates = sorted(k - 1 for k in verify_times if k > 1) if budgets is None else list(budgets)
    for budget in candidates:
        if budget + 1 not in verify_times:
            raise SpecError(f"no verify time measured for {budget + 1} tokens (budget {budget})")
    base_time = verify_times[1]
    best = TreeSizeChoice(0, 0, 1.0, base_time, 1.0) if allow_no_speculation else None
    if not candidates:
        if best is None:
            raise SpecError("no candidate budgets to choose from")
        return best
    max_nodes = max(candidates) + 1
    for budget in candidates:
        for depth in range(1, max_depth + 1):
            table = sequoia_table(profile, max_nodes, depth + 1, max_branch=max_branch)
            accept_length = table.best_value(budget + 1)
            if not np.isfinite(accept_length) or accept_length <= 0:
                continue
            time_per_token = ((depth + 1) * draft_time + verify_times[budget + 1]) / accept_length
            if best is None or time_per_token < best.time_per_token:
                best = TreeSizeChoice(budget, depth, accept_length, time_per_token, base_time / time_per_token)
    if best is None:
        raise SpecError("no feasible tree for the given budgets and depth")
    return best
