"""How much to speculate, chosen from a cost curve and an acceptance profile: the Sequoia tree size with the best
predicted time per token (``choose_tree_size``, ``--auto``'s ``choose_speculation``) and the one ``--auto`` chooser
every surface calls (``choose_auto``).

* Best-first shapes (lookup, hybrid) are sized per step: the policy keeps the cost curve and each step keeps the
  prefix of its tree with the least predicted time per token (none = a plain step), running a head level only
  when it pays (``tree/best_first.py``).
* Head-only shapes are sized once: the Sequoia tree (budget, depth) with the best predicted speedup under the
  profile's positional table, or plain decoding when none is predicted to pay (``choose_speculation``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from sglang_spec.costs import CostCurve, step_seconds
from sglang_spec.errors import SpecError
from sglang_spec.tree.policies import TreePolicy
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
    costs: CostCurve,
    max_depth: int,
    budgets: Sequence[int] | None = None,
    allow_no_speculation: bool = True,
    max_branch: int | None = None,
) -> TreeSizeChoice:
    """Best Sequoia tree size under a measured cost curve, by time per token = step_seconds / F(T).

    budgets: candidate draft-node budgets (default: every measured verify size minus one, except 0); each needs a
    measured verify time. Ties keep the first candidate in (budget, depth) order, as Sequoia's strict ``<`` does.
    """
    if 1 not in costs.verify:
        raise SpecError("the cost curve needs the one-token (plain decoding) verify time, key 1")
    if any(t <= 0 for t in costs.verify.values()) or costs.draft_level < 0 or costs.step_overhead < 0:
        raise SpecError("verify times must be positive, draft and overhead times non-negative")
    candidates = sorted(k - 1 for k in costs.verify if k > 1) if budgets is None else list(budgets)
    for budget in candidates:
        if budget + 1 not in costs.verify:
            raise SpecError(f"no verify time measured for {budget + 1} tokens (budget {budget})")
    base_time = costs.baseline_token
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
            time_per_token = step_seconds(costs, budget + 1, depth) / accept_length
            if best is None or time_per_token < best.time_per_token:
                best = TreeSizeChoice(budget, depth, accept_length, time_per_token, base_time / time_per_token)
    if best is None:
        raise SpecError("no feasible tree for the given budgets and depth")
    return best


def choose_speculation(
    profile: AcceptanceProfile, costs: CostCurve, max_depth: int = 8, min_speedup: float = 1.3
) -> TreeSizeChoice:
    """``--auto``: the Sequoia tree with the best predicted speedup, or budget 0 (plain decoding) when the best
    predicted speedup is below ``min_speedup``: a margin for what the model leaves out. The model times the verify
    forward alone, not the per-node host work of a real step (logits copy, verify rule, sampling), and on the
    2-core CI CPU it over-predicted by up to 1.3x (docs/training.md), so smaller predicted gains are not trusted."""
    choice = choose_tree_size(profile, costs, max_depth=max_depth)
    if choice.budget > 0 and choice.speedup < min_speedup:
        return TreeSizeChoice(0, 0, 1.0, costs.baseline_token, 1.0)
    return choice


@dataclass(frozen=True)
class AutoChoice:
    """What ``--auto`` chose: ``policy`` None means plain decoding; ``summary`` goes into reports."""

    policy: TreePolicy | None
    summary: dict[str, Any]


def choose_auto(policy: TreePolicy, costs: CostCurve) -> AutoChoice:
    """``policy`` with its size chosen for ``costs`` (its budget and depth are the most it may use)."""
    if policy.uses_context:
        summary = {"budget": policy.budget, "depth": policy.depth, "policy": policy.name, "device": costs.device,
                   "plain_token_seconds": costs.baseline_token}
        return AutoChoice(replace(policy, costs=costs), summary)
    profile = policy.profile if policy.profile is not None else AcceptanceProfile.load(None)
    choice = choose_speculation(profile, costs, max_depth=policy.depth)
    summary = {"budget": choice.budget, "depth": choice.depth, "predicted_speedup": choice.speedup,
               "expected_accept_length": choice.expected_accept_length, "device": costs.device}
    if choice.budget == 0:
        return AutoChoice(None, summary)
    return AutoChoice(TreePolicy("sequoia", budget=choice.budget, depth=choice.depth, profile=profile), summary)
