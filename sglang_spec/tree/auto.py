"""``--auto``: the one chooser of how much to speculate on this machine, from a measured cost curve and the
policy's acceptance profile. Every surface that offers ``--auto`` calls ``choose_auto``.

* Best-first shapes (lookup, hybrid) are sized per step: the policy keeps the cost curve and each step keeps the
  prefix of its tree with the least predicted time per token (none = a plain step), running a head level only
  when it pays (``tree/hybrid.py``).
* Head-only shapes are sized once: the Sequoia tree (budget, depth) with the best predicted speedup under the
  profile's positional table, or plain decoding when none is predicted to pay (``choose_speculation``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from sglang_spec.tree.cost_model import CostCurve, choose_speculation
from sglang_spec.tree.policies import TreePolicy
from sglang_spec.tree.profile import AcceptanceProfile


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
