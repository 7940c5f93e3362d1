"""What one speculative step costs, and the (budget, depth) whose expected accept length buys the most time per token.

One definition of a step's cost, used by ``sglang-spec generate --auto``, ``bench/acceptance.py``'s predictions and
the docs. A step with a tree of n = budget + 1 nodes (root included) and depth d costs

    step_seconds(costs, n, d) = verify(n) + d * draft_level + step_overhead

* ``verify(n)``: one target forward over the n tree tokens (measured; linear between measured sizes).
* ``d * draft_level``: a depth-d tree costs d head forwards in our decoder (``decode/decoder.py``,
  ``mtp/drafter.py``). The root's children need none: they come from the last row of the previous step's commit
  forward. Expanding tree levels 1 .. d-1 takes one batched forward each (chain, eagle and sequoia grow level by
  level; specexec's best-first rounds may take more), and the commit forward (the head over the accepted pairs,
  which also drafts the next root's children) is the d-th. A depth-1 tree thus costs one head forward per step.
* ``step_overhead``: the decoder's host work per step (tree building, masks, the verify rule, cache commits),
  measured by ``decode/autotune.measure_costs`` as a real depth-1 step minus ``step_seconds`` of that step.

The step yields F(T) tokens in expectation (Sequoia's expected accept length, bonus included); plain decoding costs
``costs.baseline_token`` per token, so the predicted speedup is ``baseline_token * F(T) / step_seconds``. Plain
decoding is a candidate too, so the choice is never predicted slower.

Sequoia's own rule (arXiv 2402.12374 §4.2, ``tree_search.py``) charges L = depth + 1 draft passes and no host work:
that is this formula with ``step_overhead = draft_level``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from sglang_spec.errors import SpecError, brief
from sglang_spec.files import finite_number
from sglang_spec.tree.profile import AcceptanceProfile
from sglang_spec.tree.sequoia import sequoia_table


@dataclass(frozen=True)
class CostCurve:
    """Seconds. verify[n] = one target forward over n tree tokens (root included) after ``prefix`` tokens;
    draft_level = one head forward over a tree level; step_overhead = the decoder's per-step host work."""

    verify: dict[int, float]
    draft_level: float
    step_overhead: float
    prefix: int
    device: str
    # plain decoding's time per token in its own loop (cache growth and sampling included), prefill excluded;
    # None in curves written before it was measured, then verify[1] stands in
    plain_token: float | None = None

    @property
    def baseline_token(self) -> float:
        """What speculation has to beat: seconds per token of plain decoding."""
        return self.plain_token if self.plain_token is not None else self.verify[1]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "verify": {str(k): v for k, v in self.verify.items()}}

    @classmethod
    def from_json(cls, data: Any) -> CostCurve:
        """A curve as ``to_json`` wrote it; anything else is a ``SpecError`` saying what is wrong."""
        if not isinstance(data, dict):
            raise SpecError("a cost curve must be a JSON object")
        unknown = sorted(set(data) - _FIELDS)
        missing = sorted(_REQUIRED - set(data))
        if unknown or missing:
            raise SpecError(f"cost curve keys: missing {missing}, unknown {unknown[:3]}")
        verify = data["verify"]
        if not isinstance(verify, dict) or not verify:
            raise SpecError("cost curve 'verify' must be a non-empty object {tokens: seconds}")
        sizes: dict[int, float] = {}
        for key, value in verify.items():
            seconds = finite_number(value)
            if not (isinstance(key, str) and key.isdigit() and 0 < int(key) <= 1 << 20):
                raise SpecError(f"cost curve 'verify' key {brief(key)} is not a token count")
            if seconds is None or seconds <= 0:
                raise SpecError(f"cost curve verify[{brief(key)}] = {brief(value)} is not a positive number of "
                                f"seconds")
            sizes[int(key)] = seconds
        times = {}
        for name in ("draft_level", "step_overhead", "plain_token"):
            if name == "plain_token" and data.get(name) is None:
                continue
            seconds = finite_number(data[name])
            if seconds is None or seconds < 0:
                raise SpecError(f"cost curve {name!r} = {brief(data[name])} is not a number of seconds >= 0")
            times[name] = seconds
        prefix = data["prefix"]
        if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
            raise SpecError(f"cost curve 'prefix' must be a token count, got {brief(prefix)}")
        if not isinstance(data["device"], str):
            raise SpecError("cost curve 'device' must be a string")
        return cls(verify=sizes, draft_level=times["draft_level"], step_overhead=times["step_overhead"],
                   prefix=prefix, device=data["device"], plain_token=times.get("plain_token"))


_FIELDS = {"verify", "draft_level", "step_overhead", "prefix", "device", "plain_token"}
_REQUIRED = _FIELDS - {"plain_token"}


def verify_seconds(costs: CostCurve, nodes: int) -> float:
    """verify(n): the measured time, linear between measured sizes, proportional past the largest."""
    return interpolate_seconds(costs.verify, nodes)


def interpolate_seconds(measured: dict[int, float], size: int) -> float:
    """A time measured at some sizes (tokens, requests), read at ``size``: linear between measured sizes, the
    smallest's below them, proportional past the largest."""
    sizes = sorted(measured)
    if size > sizes[-1]:
        return measured[sizes[-1]] * size / sizes[-1]
    if size <= sizes[0]:
        return measured[sizes[0]]
    for low, high in zip(sizes, sizes[1:]):
        if low <= size <= high:
            return measured[low] + (measured[high] - measured[low]) * (size - low) / (high - low)
    raise AssertionError("unreachable: size lies between two measured sizes")


def step_seconds(costs: CostCurve, nodes: int, depth: int) -> float:
    """Seconds of one speculative step with a tree of ``nodes`` nodes (root included) and ``depth`` draft levels."""
    return verify_seconds(costs, nodes) + depth * costs.draft_level + costs.step_overhead


def predicted_speedup(costs: CostCurve, accept_length: float, nodes: int, depth: int) -> float:
    """Plain decoding's time per token over speculation's, for a tree that yields ``accept_length`` tokens a step."""
    return costs.baseline_token * accept_length / step_seconds(costs, nodes, depth)


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
