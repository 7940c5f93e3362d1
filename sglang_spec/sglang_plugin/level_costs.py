"""``--speculative-tree-auto``'s price of a head level: what one head round and the rest of a tree step cost at
each batch size, measured on served tree steps, as the cost curve with which the tree builder decides whether a
level pays (``tree/best_first.BestFirstBuilder._level_pays``; no sglang import here).

A served tree step of batch b that ran r head rounds, t seconds of them, and took s seconds in all gives a round's
price t / r and the rest of the step s - t. The curve is flat in the node count (the step's verify size is the
planner's, already chosen) at (rest - round), with ``draft_level`` the round, so ``step_seconds`` of the step's own
forwards is s again; the commit forward (the draft extend, which drafts the next root's children) is inside the
rest, and the builder charges it as one more round. Moving averages per batch-size bucket; a bucket without a round
and a rest measured has no curve (the policy's ``mtp_levels`` run).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_spec.costs import CostCurve
from sglang_spec.sglang_plugin.step_planner import batch_bucket, moving_average

# the curve's verify time is the same for any node count up to this (past its largest size a curve grows)
FLAT_UP_TO = 1 << 20


@dataclass
class LevelCosts:
    """Seconds per batch-size bucket (``step_planner.batch_bucket``), moving averages over served tree steps."""

    round_seconds: dict[int, float] = field(default_factory=dict)  # one head round over the batch's beams
    rest_seconds: dict[int, float] = field(default_factory=dict)  # a tree step besides its head rounds
    logged: bool = False  # whether the server's log has said that levels are priced

    def observe(self, batch_size: int, step_seconds: float, rounds: int, rounds_seconds: float) -> None:
        """A served tree step of ``batch_size`` requests: ``step_seconds`` in all, ``rounds`` head rounds taking
        ``rounds_seconds`` of it."""
        bucket = batch_bucket(batch_size)
        if rounds > 0:
            self.round_seconds[bucket] = moving_average(self.round_seconds.get(bucket), rounds_seconds / rounds)
        self.rest_seconds[bucket] = moving_average(self.rest_seconds.get(bucket),
                                                   max(step_seconds - rounds_seconds, 0.0))

    def curve(self, batch_size: int) -> CostCurve | None:
        """This batch size's prices for the builder, or None while its bucket lacks a measurement."""
        bucket = batch_bucket(batch_size)
        round_seconds, rest = self.round_seconds.get(bucket), self.rest_seconds.get(bucket)
        if round_seconds is None or rest is None or round_seconds <= 0:
            return None
        # the commit forward (the draft extend) is inside the rest; the builder charges it as one more round
        verify = max(rest - round_seconds, round_seconds)  # a noisy rest shorter than a round: not below one
        return CostCurve(verify={1: verify, FLAT_UP_TO: verify}, draft_level=round_seconds, step_overhead=0.0,
                         prefix=0, device="served")

    def describe(self, batch_size: int) -> str:
        bucket = batch_bucket(batch_size)
        return (f"a head round {1e3 * self.round_seconds[bucket]:.1f} ms against {1e3 * self.rest_seconds[bucket]:.1f}"
                f" ms for the rest of a tree step")

