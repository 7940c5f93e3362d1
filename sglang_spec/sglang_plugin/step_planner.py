"""``--speculative-tree-auto``: before each decode step, how many tokens every request of the batch verifies (no sglang
import here; the hooks that run the plan are ``hooks/auto.py``).

The choice is the core planner's (``planner.choose_size``) over the verify sizes the server can run, from two
inputs this module keeps:

* **What each size would emit.** Each request's predicted reach: the reach of its last tree's nodes, best first, as its
  drafter reported them (``ServedDrafter.drafted_reach``: lookup / hybrid on the host), scaled by how much the served
  tree steps' accepted drafts exceeded or fell short of such predictions in the batch-size bucket (``accept_scale``):
  the drafts its last ``ACCEPT_WINDOW`` tree steps accepted over the drafts the drafter's reach predicted for them
  (while fewer are held, ``ACCEPT_PRIOR_STEPS`` steps that accept what they predict weigh in, fading as the window
  fills: two missed trees of SGLang's warm-up request must not price the first requests' trees at a quarter of their
  reach). A ratio of sums, not an average of each step's ratio: a step is chosen where its prediction is high, and a
  step predicted to accept little that accepts much (a large ratio) must not outweigh the many predicted high that
  accept less, or the steps the planner takes would accept fewer drafts in total than it predicted (the winner's curse).
  Where the plan keeps a request plain its prediction would go stale, so before each step the drafter estimates, without
  a forward, the reach of every request it knows nothing of and of the one whose prediction is oldest (``stale``). A
  request its drafter has not drafted yet takes the traffic's: a moving average over the requests' reports by rank. A
  drafter that reports no reach (the head-only policies, trees grown on the device) is planned from each request's own
  served accepted drafts at the full size (``UnrankedRequest``). Only tree steps teach that estimate, so it expires: a
  request with no tree step of its own, or whose last one is ``RETRY_STEPS`` steps old (doubling with each tree step it
  was served, at most ``TREE_PRICE_MEMORY``), is planned at the drafter's prior (its calibrated reach by rank), at least
  one accepted draft. Each request is tried where a tree step costs its batch little, and tried again later (a
  continuation's first tokens often have nothing to copy, its later ones do), and one request whose tree missed
  (SGLang's warm-up request, say) cannot keep trees off the others.
* **What each size would cost.** The target's verify forward measured at start-up for each batch size and verify
  size (``CostTable``: SGLang's own dummy forward, ``step_costs``), scaled per batch-size bucket by what the served
  plain steps took over it; a tree step adds the rest of the step (drafting, host work), learnt per batch-size
  bucket from its served tree steps: their time beyond the verify as the plain steps scale it, never less than the
  head rounds they measured (``ServedTreeStep``: a scale learnt from a bucket's few slow plain steps must not price
  its trees' drafting at nothing, nor lend that nothing to a large batch). A bucket with no tree step of its own
  borrows a neighbour's price: a smaller bucket's grown to it (its drafting as the start-up verify forward of the
  head's beams a request grows between the two, the rest as the plain forward grows: both grow with the batch
  where the forward is compute-bound, and a tree that loses costs a large batch most), a larger one's per request,
  at the most it would be (part of it is the step's whatever the batch), so one slow step at four requests cannot
  price trees out at one.
  Both corrections are the median of the last ``WINDOW`` served steps of their kind; the tree steps' is forgotten
  after ``TREE_PRICE_MEMORY`` steps (plain steps run whatever the plan, tree steps only where it predicts they
  pay: a price that keeps trees off is never corrected by a served tree step, so it expires and a tree is tried
  again). The first step of each shape (batch bucket, size) also allocates for it, and a new request's context
  index is built once: neither is counted.

**The head at rest.** A plain step still runs the head's draft extend over its token (SGLang's zero-step path),
so that a tree can follow at once. Where plain steps run long (trees do not pay at this load), that extend is a
cost with nothing to show: after ``head_rest`` plain steps in a row, a plain step leaves it out (``skip_head``: the
head's KV slots of its tokens are zeroed, its outputs stubbed). The step after one that left it out holds no head
candidates, so a tree chosen then is taken as a plain step that runs the extend (a warm-up, ``head_warmup``), and
the tree may follow the step after. The rule reads the agreed sizes alone (``take``), so every rank of a
tensor-parallel group rests the head at the same steps. (Under DP attention one rank may prefill, running the head,
while another decodes, so there the head runs every step: ``head_rest`` None.)

A step is capped at ``cap`` times a plain step's predicted time (the gap a streaming client sees between chunks).
Where the server verifies ragged (``ragged``: each request's forward covers its own tree, ``ragged_verify``), the
step gives each request its own share of nodes (``planner.plan_ragged``: the batch's nodes best first across its
requests, the step priced at the tokens it verifies; a request with no share decodes plainly inside a tree step),
and a served step is priced at the tokens it verified. Elsewhere the plan is one size for the whole batch (SGLang
verifies a fixed number of tokens a request per step); a request whose tree is smaller verifies filler nodes beside
it. The ranks of a tensor-parallel group (and of every DP attention group) agree on the plan's inputs before
choosing (``peers.PlanGroup``), and on a ragged plan's shares (the least of each), so every rank takes the same step
whatever its local timings.
"""

from __future__ import annotations

import json
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence, TextIO

from sglang_spec.costs import CostTable, interpolate_seconds
from sglang_spec.planner import SizeTable, StepPlan, choose_size, expected_tokens, plan_ragged, width_for

SMOOTHING = 0.3  # weight of the newest step in the moving averages (the accept scale, the prior)
WINDOW = 9  # served steps a cost correction is the median of (one slow step of a shared machine moves nothing)
TREE_PRICE_MEMORY = 128  # steps a served tree step's price is kept: then trees are tried again at their verify's
DEFAULT_CAP = 2.0  # a tree step's predicted time at most this many plain steps'
EXPLORED_ACCEPTED = 1.0  # unranked drafters: accepted drafts a request with no tree step of its own is planned at
RETRY_STEPS = 8  # unranked drafters: steps a request's first tree step is its estimate for (doubling each tree step)
ACCEPT_SCALE_RANGE = (0.25, 2.0)  # an accept scale is kept within this range (one odd step cannot flip the plan)
ACCEPT_WINDOW = 32  # tree steps of a batch-size bucket its accept scale is the ratio of sums over
ACCEPT_PRIOR_STEPS = 4.0  # tree steps at scale 1 an empty window holds, fading as served ones fill it
SPARE_REQUESTS = 256  # per-request predictions kept beyond the batch's before finished requests are dropped
GPU_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # verify sizes a GPU server captures graphs for
PLAN_LOG_ENV = "SGLANG_SPEC_PLAN_LOG"  # a file: every planned step as a JSON line (read once, at start-up)


def default_sizes(full: int, graphs: bool, ranked: bool) -> tuple[int, ...]:
    """The verify sizes a server may take: every size up to its tree without decode graphs (nothing is captured),
    the GPU tiers below it with them (each size needs its own graphs), always 1 and the full tree; the plain step
    and the full tree only for a drafter that reports no per-node reach (its trees cannot be cut)."""
    if not ranked:
        return tuple(sorted({1, full}))
    sizes = [size for size in GPU_SIZES if size < full] if graphs else range(1, full + 1)
    return tuple(sorted({1, *sizes, full}))


def batch_bucket(batch_size: int) -> int:
    """The next power of two at or above the batch size."""
    return 1 << max(batch_size - 1, 0).bit_length()


def moving_average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


@dataclass(frozen=True)
class UnrankedRequest:
    """What an unranked drafter's request showed in its served tree steps.

    accepted:   its accepted drafts a tree step (a moving average).
    served_at:  the planner's step count at its last tree step.
    tree_steps: its tree steps served so far (>= 1)."""

    accepted: float
    served_at: int
    tree_steps: int


@dataclass(frozen=True)
class ServedTreeStep:
    """One served tree step, as its bucket's tree price reads it.

    step:     the planner's step count when it was served.
    seconds:  its served time (a new request's one-time set-up left out).
    forward:  the start-up table's verify forward of the tokens it verified (scaled by the plain steps when read).
    drafting: the seconds its head rounds took, measured (0: none, or not measured): the least its rest can be,
              whatever the plain steps' scale says of the verify."""

    step: int
    seconds: float
    forward: float
    drafting: float = 0.0

    def rest(self, plain_scale: float) -> float:
        """Its time beyond its verify forward as a plain step scaled by ``plain_scale`` would take it, at least
        its drafting."""
        return max(self.seconds - plain_scale * self.forward, self.drafting, 0.0)


@dataclass
class StepPlanner:
    """The server's plan state.

    costs:          start-up verify forwards (None: not measured; the served steps alone price the sizes).
    sizes:          the verify sizes a step may take (tokens a request, root included), ascending, 1 and ``full``
                    among them.
    full:           the server's tree: budget + 1 tokens a request.
    cap:            a tree step's predicted time at most ``cap`` plain steps'.
    width:          the beams a request the head's rounds run (SGLang's ``speculative_eagle_topk``): a borrowed
                    tree price's drafting grows as a forward of that many tokens a request (``_grown_rest``).
    ranked:         whether the drafter reports per-node reach (lookup / hybrid on the host).
    ragged:         whether each request's verify forward covers its own tree (``ragged_verify``): the step then
                    gives each request its own share of nodes (``ragged_plan``), not one size to all.
    head_rest:      plain steps in a row after which a plain step leaves the head's draft extend out; None: never
                    (a drafter that never runs the head, DP attention, a pool whose slots cannot be zeroed).
    tiers:          where ragged steps replay SGLang's ragged verify graphs (``ragged_verify``): the full tree's
                    token tiers, ascending; a ragged step then runs at the full width and is priced at its tier
                    (the tier's pad tokens are computed anyway, so the plan fills them with its next-best nodes).
                    None: priced at the tokens it verifies.
    Per step, set by ``take`` (the agreed size as the step takes it):
    plain_run:      plain steps the group took in a row, this one included.
    skip_head:      this step leaves the head's draft extend out (read by the draft extend's hook).
    head_warmup:    this step is a tree taken plain, because the last step left the head out.
    """

    costs: CostTable | None
    sizes: tuple[int, ...]
    full: int
    cap: float = DEFAULT_CAP
    width: int = 1
    ranked: bool = True
    ragged: bool = False
    head_rest: int | None = None
    tiers: tuple[int, ...] | None = None
    plain_run: int = 0
    skip_head: bool = False
    head_warmup: bool = False
    reach_of: dict[str, tuple[float, ...]] = field(default_factory=dict)  # rid -> its last tree's reach, best first
    prior: list[float] = field(default_factory=list)  # the traffic's reach by rank (moving averages)
    accepted_of: dict[str, UnrankedRequest] = field(default_factory=dict)  # rid -> its served trees (unranked)
    accepted_seen: dict[int, deque[tuple[float, float]]] = field(default_factory=dict)  # bucket -> (accepted
    # drafts, drafts its reach predicted before the scale) of its last ACCEPT_WINDOW tree steps
    plain_seen: dict[int, deque[float]] = field(default_factory=dict)  # bucket -> recent served plain / forward
    tree_seen: dict[int, deque[ServedTreeStep]] = field(default_factory=dict)  # bucket -> its recent tree steps
    served: dict[tuple[int, int], float] = field(default_factory=dict)  # (bucket, size) -> seconds, no start-up table
    chosen: Counter[int] = field(default_factory=Counter)  # steps by verify size
    idle_steps: int = 0  # steps this rank ran with no request of its own at the group's size (DP attention)
    learnt_at: dict[str, int] = field(default_factory=dict)  # rid -> the step its reach was last learnt at
    log_path: str | None = None  # ``PLAN_LOG_ENV``: where every planned step is written, one JSON line each
    log_file: TextIO | None = field(default=None, repr=False)  # ``log_path`` opened at the first step written

    def __post_init__(self) -> None:
        if self.sizes[0] != 1 or self.full not in self.sizes or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"verify sizes must be ascending from 1 and include the tree's {self.full}: {self.sizes}")
        if not self.cap >= 1.0:
            raise ValueError(f"the step cap must be >= 1 plain step, got {self.cap}")
        if self.width < 1:
            raise ValueError(f"the head's rounds run >= 1 beam a request, got {self.width}")
        if self.head_rest is not None and self.head_rest < 1:
            raise ValueError(f"the head rests after >= 1 plain step, got {self.head_rest}")

    def head_swapped(self, prior: list[float]) -> None:
        """A new head serves (``WorkerState.swap_head``): what was learnt of the old head's acceptance (each
        request's reach and accepted drafts, the traffic's, the served accept scale) is forgotten, ``prior`` the
        traffic's reach by rank again (the drafter's, after it forgot too); the costs stay."""
        self.reach_of.clear()
        self.prior = list(prior)
        self.accepted_of.clear()
        self.learnt_at.clear()
        self.accepted_seen.clear()

    # -------------------------------------------------------------------------------------------- the plan
    def accept_scale(self, bucket: int) -> float:
        """The factor on the drafter's reach in a batch-size bucket: its recent tree steps' accepted drafts over their
        predicted ones (beside fading prior steps at 1 while its window is not full), within
        ``ACCEPT_SCALE_RANGE``; a bucket with none takes the nearest one's (a smaller first), 1.0 before any tree
        step."""
        nearest = _nearest(bucket, [seen for seen, held in self.accepted_seen.items() if held])
        if nearest is None:
            return 1.0
        held = self.accepted_seen[nearest]
        predicted = sum(value for _, value in held)
        low, high = ACCEPT_SCALE_RANGE
        if predicted <= 0:
            return high
        # a few steps are not yet the traffic's (SGLang's warm-up request misses its tree): until the window fills,
        # prior steps that accept what they predicted (the window's mean) weigh in, fewer the more steps are served
        prior = ACCEPT_PRIOR_STEPS * (1 - len(held) / ACCEPT_WINDOW) * predicted / len(held)
        return min(max((sum(value for value, _ in held) + prior) / (predicted + prior), low), high)

    def predicted_reach(self, rid: str, batch_size: int = 1) -> list[float]:
        """The request's draft nodes' predicted reach, best first, in a batch of ``batch_size``: its drafter's
        estimates, then the traffic's by rank capped at its own worst, scaled by the batch's accept scale (ranked
        drafters); its served accepted drafts at the full size (the others)."""
        return self._scaled_reach(rid, self.accept_scale(batch_bucket(batch_size)))

    def _scaled_reach(self, rid: str, scale: float) -> list[float]:
        """``predicted_reach`` with the batch's accept scale read once for the whole batch by the caller."""
        if not self.ranked:  # the whole tree or nothing: its served accepted drafts, at the full size
            return [0.0] * (self.full - 2) + [self.accepted_drafts(rid)]
        own = self.reach_of.get(rid, ())
        # past its own nodes, the traffic's by rank, never above its own worst: a tree grows best first
        ceiling = min(own, default=1.0)
        rest = [min(value, ceiling) for value in self.prior[len(own):self.full - 1]]
        return [min(value * scale, 1.0) for value in list(own) + rest]

    def accepted_drafts(self, rid: str) -> float:
        """An unranked drafter's request: its accepted drafts a tree step, as its served tree steps averaged them,
        while its last is recent (module doc); else the drafter's prior (the sum of its reach by rank), at least
        ``EXPLORED_ACCEPTED``."""
        own = self.accepted_of.get(rid)
        if own is not None and self.steps - own.served_at < min(RETRY_STEPS << (own.tree_steps - 1),
                                                               TREE_PRICE_MEMORY):
            return own.accepted
        # at least one: a calibrated average below a tree's break-even would never let a request show its own
        return max(sum(self.prior[: self.full - 1]), EXPLORED_ACCEPTED)

    @property
    def steps(self) -> int:
        """Steps planned so far."""
        return sum(self.chosen.values())

    def tree_extra(self, bucket: int) -> float | None:
        """A tree step's time beyond its verify in a batch-size bucket: the median of its served tree steps within the
        last ``TREE_PRICE_MEMORY`` steps, each over its verify as the plain steps price it now (a tree step served
        before the plain steps showed how far the start-up table is off is not charged for that), at least its
        measured drafting (``ServedTreeStep.rest``); a bucket with none takes the nearest smaller bucket's steps
        grown to it (``_grown_rest``: a wrong try costs a large batch most), else the nearest larger one's per
        request times the bucket (at most what it would be: a try at a smaller batch costs little); None: no bucket
        has one that recent. The median, not the least: one fast tree step among slower ones must not keep buying
        trees that lose to a plain step. A price that expires: only tree steps can correct it, so a slow spell of a
        busy machine must not keep trees off for good; where trees do not pay, one is retried every
        ``TREE_PRICE_MEMORY`` steps."""
        recent = {}
        for seen, held in self.tree_seen.items():
            kept = [served for served in held if served.step > self.steps - TREE_PRICE_MEMORY]
            if kept:
                recent[seen] = kept
        nearest = _nearest(bucket, recent)
        if nearest is None:
            return None
        scale = self.plain_scale(nearest)
        if nearest > bucket:
            return _median(served.rest(scale) * bucket / nearest for served in recent[nearest])
        # the head's rounds run ``width`` beams a request, the host's work is per request (``_grown_rest``)
        drafting_growth = self._forward_growth(nearest, bucket, min(self.width, self.full))
        host_growth = self._forward_growth(nearest, bucket, 1)
        return _median(_grown_rest(served, scale, drafting_growth, host_growth) for served in recent[nearest])

    def _forward_growth(self, smaller: int, bucket: int, tokens: int) -> float:
        """The start-up table's forward of ``tokens`` a request at ``bucket`` requests over its forward at
        ``smaller``, at least 1 (1 without a table)."""
        if self.costs is None or smaller == bucket:
            return 1.0
        grown = _verify_at(self.costs.at(bucket).verify, tokens) / _verify_at(self.costs.at(smaller).verify, tokens)
        return max(grown, 1.0)

    def plain_scale(self, bucket: int) -> float:
        """Served plain steps over the start-up forward in a batch-size bucket (the median of its recent ones); a
        bucket with none takes the nearest one's (a smaller first), 1.0 before any."""
        nearest = _nearest(bucket, [seen for seen, scales in self.plain_seen.items() if scales])
        scale = None if nearest is None else _median(self.plain_seen[nearest])
        return 1.0 if scale is None else scale

    def seconds(self, batch_size: int, size: int) -> float:
        """A step's predicted time for ``batch_size`` requests verifying ``size`` tokens each."""
        return self._step_seconds(batch_size)(size)

    def table(self, rids: Sequence[str]) -> SizeTable:
        """What every size would give a batch of these requests (what the ranks of a group agree on)."""
        scale = self.accept_scale(batch_bucket(len(rids)))
        reach = [self._scaled_reach(rid, scale) for rid in rids]
        step_seconds = self._step_seconds(len(rids))
        return SizeTable(self.sizes, tuple(expected_tokens(reach, size) for size in self.sizes),
                         tuple(step_seconds(size) for size in self.sizes))

    def _step_seconds(self, batch_size: int) -> Callable[[int], float]:
        """A step's predicted time by verify size for ``batch_size`` requests: the bucket's corrections and the
        batch's start-up curve read once, for every size a table prices."""
        bucket = batch_bucket(batch_size)
        if self.costs is None:
            # unmeasured: a size not served yet is priced as the plain step (so it gets tried once); nothing served
            # yet, every size alike (the most expected tokens win)
            plain = self.served.get((bucket, 1), 1.0)
            return lambda size: self.served.get((bucket, size), plain)
        verify = self.costs.at(batch_size).verify
        scale, extra = self.plain_scale(bucket), self.tree_extra(bucket) or 0.0
        return lambda size: scale * _verify_at(verify, size) + (0.0 if size == 1 else extra)

    def choose(self, table: SizeTable, batch_size: int) -> StepPlan:
        """The plan for the (agreed) table, as the step takes it (``take``)."""
        size, expected, seconds = choose_size(table, self.cap * table.seconds[0])
        taken = self.take(size)
        if taken != size:
            expected, seconds = table.expected[0], table.seconds[0]
        return StepPlan(taken, expected, seconds, (taken - 1,) * batch_size)

    def ragged_plan(self, table: SizeTable, rids: Sequence[str]) -> StepPlan:
        """Each request's share of the step's nodes (``planner.plan_ragged``) from its predicted reach, priced by
        the (agreed) table at the tokens the step verifies (on ragged verify graphs: its tier's); not yet taken
        (``take_ragged``, once the group agreed on the shares)."""
        scale = self.accept_scale(batch_bucket(len(rids)))
        reach = [self._scaled_reach(rid, scale) for rid in rids]
        seconds = tiered_seconds(ragged_seconds(table), self.tiers, len(rids))
        return plan_ragged(reach, seconds, self.ragged_widths, self.cap * table.seconds[0])

    @property
    def ragged_widths(self) -> tuple[int, ...]:
        """The widths a ragged step may run at: every size, or on ragged verify graphs (``tiers``, the full
        tree's) a plain step or the full width."""
        return self.sizes if self.tiers is None else (1, self.full)

    def take_ragged(self, table: SizeTable, plan: StepPlan, nodes: Sequence[int]) -> StepPlan:
        """The ragged plan with the group's agreed shares ``nodes`` (the same as ``plan``'s on every rank that
        predicts alike), as the step takes it (``take``: a tree right after the head rested is a plain step)."""
        width = width_for(nodes, self.ragged_widths)
        if tuple(nodes) != plan.nodes:
            seconds = tiered_seconds(ragged_seconds(table), self.tiers, len(nodes))
            plan = StepPlan(width, plan.expected_tokens, seconds(1.0 + sum(nodes) / len(nodes)), tuple(nodes))
        taken = self.take(width)
        if taken != width:
            return StepPlan(1, table.expected[0], table.seconds[0], (0,) * len(nodes))
        return plan

    def size_for(self, table: SizeTable) -> int:
        """The verify size ``choose`` takes for the (agreed) table, not counted as a step: what a rank with no
        request of its own runs beside the group's (a function of the agreed table alone, as on every rank; its
        head rests at the group's steps, ``take``)."""
        return self._rest_head(choose_size(table, self.cap * table.seconds[0])[0])

    def take(self, size: int) -> int:
        """The verify size this rank's decode step takes for the group's agreed ``size`` (``_rest_head``), counted
        in ``chosen``: called once a step with the agreed size (a failed plan: 1)."""
        taken = self._rest_head(size)
        self.chosen[taken] += 1
        return taken

    def _rest_head(self, size: int) -> int:
        """The verify size a step takes for the group's agreed ``size``, with the head's part in it (module doc,
        the head at rest): a tree right after a step that left the head out is a plain warm-up step. Every rank
        calls it once a decode step with the agreed size (``take``, or ``size_for`` on a rank with no request), so
        ``skip_head`` is the group's."""
        self.head_warmup = size > 1 and self.skip_head
        if self.head_warmup:
            size = 1
        self.plain_run = self.plain_run + 1 if size == 1 else 0
        self.skip_head = (self.head_rest is not None and not self.head_warmup and size == 1
                          and self.plain_run > self.head_rest)
        return size

    # -------------------------------------------------------------------------------------------- learning
    def observe(self, plan: StepPlan, rids: Sequence[str], seconds: float, accept_lens: Sequence[int],
                verified_tokens: int | None = None, drafting_seconds: float = 0.0) -> None:
        """A served step of ``plan`` took ``seconds`` and each request committed ``accept_lens`` tokens (accepted
        drafts + 1): its costs, and for a tree step how its accepted drafts compare with the prediction.
        ``verified_tokens``: what a ragged step's forward verified, the batch's total (None: ``plan.tokens`` a
        request); on ragged verify graphs its forward computed its tier's. ``drafting_seconds``: what a tree step's
        head rounds took, measured (``ServedTreeStep.drafting``)."""
        batch = len(rids)
        bucket = batch_bucket(batch)
        first = (bucket, plan.tokens) not in self.served  # a shape's first step also allocates: not its price
        self.served[bucket, plan.tokens] = moving_average(self.served.get((bucket, plan.tokens)), seconds)
        if self.costs is not None and not first:
            size = plan.tokens if verified_tokens is None else tier_tokens(verified_tokens, self.tiers) / batch
            forward = _verify_at(self.costs.at(batch).verify, size)
            if plan.plain:
                self.plain_seen.setdefault(bucket, deque(maxlen=WINDOW)).append(seconds / forward)
            else:
                self.tree_seen.setdefault(bucket, deque(maxlen=WINDOW)).append(
                    ServedTreeStep(self.steps, seconds, forward, drafting_seconds))
        if plan.plain:
            return
        drafts = [max(int(length) - 1, 0) for length in accept_lens]
        predicted = plan.expected_tokens - batch
        if predicted > 0 and self.ranked:
            # the plan's reach was scaled by the bucket's scale as it is now (only tree steps move it); a node scaled
            # past 1 was capped there, so this may read a little under what the drafter predicted
            unscaled = predicted / self.accept_scale(bucket)
            self.accepted_seen.setdefault(bucket, deque(maxlen=ACCEPT_WINDOW)).append((float(sum(drafts)), unscaled))
        if not self.ranked and plan.tokens == self.full:
            for rid, accepted in zip(rids, drafts):
                own = self.accepted_of.get(rid)
                self.accepted_of[rid] = UnrankedRequest(
                    moving_average(None if own is None else own.accepted, accepted), self.steps,
                    1 if own is None else own.tree_steps + 1)
        self._forget_finished(rids)

    def stale(self, rids: Sequence[str]) -> list[str]:
        """The requests whose prediction to refresh before this step: every one with none, and the one learnt the
        longest ago."""
        unknown = [rid for rid in rids if rid not in self.learnt_at]
        known = [rid for rid in rids if rid in self.learnt_at]
        oldest = min(known, key=lambda rid: self.learnt_at[rid]) if known else None
        return unknown + ([oldest] if oldest is not None else [])

    def learn_reach(self, drafted: Mapping[str, Sequence[float]]) -> None:
        """The reach of the trees just drafted or estimated (rid -> best first), as the drafter rated them: each
        request's prediction for its next step, and the traffic's by rank."""
        step = self.steps
        for rid, reach in drafted.items():
            self.learnt_at[rid] = step
            self.reach_of[rid] = tuple(reach)
            for rank, value in enumerate(reach[: self.full - 1]):
                if rank < len(self.prior):
                    self.prior[rank] = moving_average(self.prior[rank], value)
                else:
                    self.prior.append(value)

    def _forget_finished(self, rids: Sequence[str]) -> None:
        for held in (self.reach_of, self.accepted_of, self.learnt_at):
            if len(held) > len(rids) + SPARE_REQUESTS:
                alive = set(rids)
                for rid in [rid for rid in held if rid not in alive]:
                    del held[rid]

    def write_log(self, plan: StepPlan, rids: Sequence[str], seconds: float, accept_lens: Sequence[int]) -> None:
        """One planned step as a JSON line in ``log_path``: the step's index (``steps``, the same on every rank of a
        tensor-parallel group), batch, size, each request's verify tokens, expected tokens, predicted and served
        seconds, tokens each request committed, and the corrections the planner holds."""
        assert self.log_path is not None
        record = {"step": self.steps, "batch": len(rids), "tokens": plan.tokens,
                  "verify_tokens": list(plan.verify_tokens(self.ragged)), "expected": round(plan.expected_tokens, 3),
                  "predicted_s": round(plan.predicted_seconds, 5), "served_s": round(seconds, 5),
                  "committed": list(accept_lens), "accept_scale": round(self.accept_scale(batch_bucket(len(rids))), 3),
                  "head": "rest" if self.skip_head else "warmup" if self.head_warmup else "ran",
                  "tree_extra_s": self.tree_extra(batch_bucket(len(rids))),
                  "plain_scale": {bucket: self.plain_scale(bucket) for bucket in self.plain_seen}}
        if self.log_file is None:
            # opened once and line-buffered: one append a step (whole lines, so ranks sharing the file interleave
            # lines, not bytes), not an open and close on every step's host time
            self.log_file = open(self.log_path, "a", buffering=1)
        self.log_file.write(json.dumps(record) + "\n")

    def describe(self) -> str:
        """One log line: the steps taken by verify size so far."""
        return ", ".join(f"{size}: {count}" for size, count in sorted(self.chosen.items()))


def ragged_seconds(table: SizeTable) -> Callable[[float], float]:
    """A step's predicted seconds when its requests verify ``t`` tokens each on average (root included; a float),
    read off a table priced by uniform sizes: the plain step at ``t`` 1, a tree step linear between the sizes
    (below the smallest tree size, that size's: a tree step pays its drafting whatever its size)."""
    plain = table.seconds[0]
    trees = {size: seconds for size, seconds in zip(table.sizes, table.seconds) if size > 1}
    if not trees:
        return lambda tokens: plain
    return lambda tokens: plain if tokens <= 1 else interpolate_seconds(trees, tokens)



def tiered_seconds(seconds: Callable[[float], float], tiers: Sequence[int] | None,
                   batch: int) -> Callable[[float], float]:
    """``seconds`` (of a step whose ``batch`` requests verify ``t`` tokens each on average) for a step on ragged
    verify graphs: a tree step computes the tokens of its tier, the smallest of ``tiers`` holding the batch's (past
    the largest, its own: it runs eager); a plain step is as it is. None: ``seconds`` itself."""
    if not tiers:
        return seconds

    def priced(tokens: float) -> float:
        return seconds(tokens) if tokens <= 1 else seconds(tier_tokens(round(tokens * batch), tiers) / batch)

    return priced


def tier_tokens(total: int, tiers: Sequence[int] | None) -> int:
    """The tokens a ragged step of ``total`` verify tokens computes: its tier's (the smallest of ``tiers`` holding
    it), its own past the largest tier or without tiers."""
    return next((tier for tier in tiers or () if tier >= total), total)


def _grown_rest(served: ServedTreeStep, plain_scale: float, drafting_growth: float, host_growth: float) -> float:
    """A tree step's rest as a larger batch would take it: its drafting grown by ``drafting_growth`` (the start-up
    verify forward of the head's beams a request, between the two batch sizes), the rest of it by ``host_growth``
    (the plain forward's). Where the forward is compute-bound both grow with the batch, the head's rows faster;
    where it is memory-bound (a GPU's decode) neither grows much."""
    rest = served.rest(plain_scale)
    drafting = min(served.drafting, rest)
    return drafting * drafting_growth + (rest - drafting) * host_growth


def _nearest(bucket: int, buckets: Iterable[int]) -> int | None:
    """``bucket`` itself if among ``buckets``, else the largest smaller one, else the smallest larger one (None:
    no buckets)."""
    known = sorted(set(buckets))
    if bucket in known:
        return bucket
    smaller = [seen for seen in known if seen < bucket]
    return smaller[-1] if smaller else (known[0] if known else None)


def _median(values: Iterable[float]) -> float | None:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def _verify_at(verify: Mapping[int, float], size: float) -> float:
    """The forward's time at ``size`` tokens a request, linear between measured sizes."""
    return interpolate_seconds(dict(verify), size)
