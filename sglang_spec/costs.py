"""What one speculative step costs, and what it buys: the one cost type (``CostCurve``, and ``CostTable`` of curves by
batch size) and the one predicted speedup, used by the reference decoder's ``--auto``, the plugin's tree auto and
the benchmarks' predictions. A step with a tree of n = budget + 1 nodes (root included) and depth d costs

    step_seconds(costs, n, d) = verify(n) + d * draft_level + step_overhead

* ``verify(n)``: one target forward over the n tree tokens (measured; linear between measured sizes).
* ``d * draft_level``: a depth-d tree costs d head forwards in our decoder (``decode/decoder.py``,
  ``mtp/expansion.py``). The root's children need none: they come from the last row of the previous step's commit
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
from typing import Any, Mapping

from sglang_spec.errors import SpecError, brief
from sglang_spec.files import finite_number


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


def interpolate_seconds(measured: dict[int, float], size: float) -> float:
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
class CostTable:
    """Step costs by batch size: ``curves[b]`` is a batch of b requests' ``CostCurve`` (its verify[n] = one target
    forward over n tokens a request, b requests; its ``baseline_token`` the batch's plain step). Read at any batch
    size by interpolating each curve's times between the measured batch sizes (``at``)."""

    curves: Mapping[int, CostCurve]

    def __post_init__(self) -> None:
        if not self.curves:
            raise ValueError("a cost table needs at least one batch size")
        sizes = {frozenset(curve.verify) for curve in self.curves.values()}
        if len(sizes) != 1:
            raise ValueError("every batch size's curve needs the same verify sizes")

    def at(self, batch_size: int) -> CostCurve:
        """The curve of a batch of ``batch_size`` requests (interpolated between measured sizes)."""
        if batch_size in self.curves:
            return self.curves[batch_size]
        any_curve = next(iter(self.curves.values()))
        curves = self.curves.items()

        def read(measured: dict[int, float]) -> float:
            return interpolate_seconds(measured, batch_size)

        verify = {tokens: read({size: curve.verify[tokens] for size, curve in curves}) for tokens in any_curve.verify}
        plain = None if any_curve.plain_token is None else read({size: c.baseline_token for size, c in curves})
        return CostCurve(verify=verify, draft_level=read({size: c.draft_level for size, c in curves}),
                         step_overhead=read({size: c.step_overhead for size, c in curves}), prefix=any_curve.prefix,
                         device=any_curve.device, plain_token=plain)

    def describe(self) -> str:
        """One log line: the largest verify over a plain step's forward, per batch size."""
        parts = []
        for size in sorted(self.curves):
            curve = self.curves[size]
            largest = max(curve.verify)
            parts.append(f"{size}: {curve.verify[largest] / curve.verify[min(curve.verify)]:.2f}x")
        return ", ".join(parts)
