"""``--speculative-tree-auto``'s price of a head level: what one head round and the rest of a tree step cost at
each batch size, measured on served tree steps, as the cost curve with which the tree builder decides whether a
level pays (``tree/best_first.BestFirstBuilder._level_pays``; no sglang import here).

SGLang verifies a fixed number of tokens a request whatever the tree (``drafters.padding.pad_to_budget``), so a tree
step's cost does not depend on its nodes, only on its head forwards: one per level the builders asked for, and the
draft extend that drafts the next root's children (the commit forward the builder charges as one more). A served
tree step of batch b that ran r rounds, t seconds in all, and took s seconds gives a round's price t / r and the
rest of the step s - t: the curve is flat in the node count (trees are padded) at (rest - round), with
``draft_level`` the round, so ``step_seconds`` of the step's own forwards is s again. Moving averages per
batch-size bucket; a bucket without a round and a rest measured has no curve (the policy's ``mtp_levels`` run, as
without tree auto).

On the CPU bed, extraction at one request (#19's concurrency 1): the fixed hybrid trees accepted 2.41 tokens a step
over six prompts with one head level and with three, and one prompt's step took 60.6 against 70.4 ms
(``docs/results/serving_sweep.md``, fifteenth session).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_spec.sglang_plugin.batch_switch import batch_bucket, moving_average
from sglang_spec.costs import CostCurve

# the curve's verify time is the same for any node count up to this (past its largest size a curve grows)
FLAT_UP_TO = 1 << 20


@dataclass
class LevelCosts:
    """Seconds per batch-size bucket (``batch_switch.batch_bucket``), moving averages over served tree steps."""

    round_seconds: dict[int, float] = field(default_factory=dict)  # one head round over the batch's beams
    rest_seconds: dict[int, float] = field(default_factory=dict)  # a tree step besides its head rounds
    logged: bool = False  # whether the server's log has said that levels are priced

    def observe(self, batch_size: int, step_seconds: float, rounds: int, rounds_seconds: float) -> None:
        """A served tree step of ``batch_size`` requests: ``step_seconds`` in all, ``rounds`` head rounds taking
        ``rounds_seconds`` of it."""
        bucket = batch_bucket(batch_size)
        if rounds > 0:
            _average(self.round_seconds, bucket, rounds_seconds / rounds)
        _average(self.rest_seconds, bucket, max(step_seconds - rounds_seconds, 0.0))

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


def _average(averages: dict[int, float], bucket: int, seconds: float) -> None:
    previous = averages.get(bucket)
    averages[bucket] = seconds if previous is None else moving_average(previous, seconds)
