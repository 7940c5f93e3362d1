"""``--speculative-tree-auto``: each decode step of the running batch is a tree step or a plain step, decided from
costs measured at start-up per batch size and what steps deliver on the served traffic (no sglang import here).

A tree pays when its accepted tokens outweigh what verifying and drafting it cost over a plain step; both move with
the batch size (a batch of 16 fills the target's forward, so a tree's extra tokens stop being nearly free) and with
the traffic (copy-heavy prompts accept more). Two layers decide:

* **Prediction.** ``StepCosts`` holds the target's verify forward timed at start-up for each batch size at the
  tree's tokens and at one token per request (``step_costs.py``: SGLang's own dummy forward). A batch of b is
  predicted to speed up by ``accept_length * plain(b) / tree(b)``, where accept_length is the tokens a request
  gains per tree step: the mean over the batch's requests of each one's own running mean (a request's content,
  copy-heavy or not, decides what its trees accept; a request not yet seen starts from the traffic's moving
  average over all requests and batch sizes), and plain / tree are the start-up
  times scaled by what served plain and tree steps took over their start-up prediction (moving averages: drafting,
  host work and long contexts are in the scale, not in the table; a tree step's, per batch-size bucket once the
  bucket served one). Where the prediction is below
  ``COLD_BELOW`` even at the prior accept length (a floor: trees lose whatever the traffic accepts) the step is
  plain without trying trees (a tree step now and then, at most ``PROBE_SHARE`` of the time, keeps the accept
  length current; priced per warm request, since only they teach it): under load speculation is off from the
  first step. Those steps are *cold*: the target decodes
  and the head's forward over the new token is skipped (SGLang's own stub for a skipped draft extend); when trees
  return for those requests, the head drafts without its KV for the cold positions (it accepts less there;
  verification keeps the output exact). So the accept length is learnt from requests with a warm head only: a
  request that took a cold step would report the stale head, not the traffic (and, learnt, keep itself cold).
  A prompt admitted while the batch it joins is cold (``admit``) skips the head's pass over it as well (its
  prefill's draft extend, 4% of the prefill on the CPU bed): the request is cold from its first token.
  Between ``COLD_BELOW`` and even, once the accept length is learnt (``WINDOW`` tree steps), a batch of two or
  more that is predicted to lose takes warm plain steps (the head's draft extend runs, so trees return at no cost
  in acceptance), with a tree step at most ``BAND_PROBE_SHARE`` of the time: on the CPU bed the prediction at
  batch 16 on code (0.8-0.9x) was what served tree steps delivered, and trying trees there at every measured
  verdict cost 5-10% of throughput. One request is left to the measured switch (below), as the reference
  decoder's ``--auto`` does: there a tree step costs about two plain steps, its accept length swings from one
  step to the next, and holding plain on the prediction lost a third of the trees' gain on code.
* **A clear win.** Where trees are predicted to win by ``TRUSTED_WIN`` or more at the learnt accept length, the
  step is a tree step, whatever the measured switch last said (it is not fed those steps).
* **Measurement.** Elsewhere each batch-size bucket (1, 2, 3-4, 5-8, ...) has a ``decode/switch.SpeculationSwitch``,
  the reference decoder's own guard, whose plain-decoding prior is the predicted plain time: it weighs the wall time
  per emitted token of the bucket's recent tree steps against its plain steps'; a loss takes a stretch of plain
  steps (doubling while probes keep losing), then probes trees again.

Without a table (``costs=None``) the switch starts from a ~0 s prior and measures plain steps before it judges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from sglang_spec.decode.switch import SpeculationSwitch
from sglang_spec.costs import interpolate_seconds

_NO_PRIOR = 1e-9  # seconds a token: any tree loses against it, which measures plain steps first
# a batch step weighs every request's tokens, so fewer steps make a verdict than for one request (the reference
# decoder's window 8 / probe 4): served runs are short, and each batch size explores on its own
WINDOW, PROBE_STEPS = 4, 2
# predicted speedup (at no less than the prior accept length) below which a batch size takes cold plain steps
# instead of trying trees: a clear loss only. Between it and 1.0 the measured switch decides with warm plain steps,
# because a cold step costs the request its head's KV for good, and a near-even prediction is within the error of
# the scales (moving averages over all batch sizes' served steps)
COLD_BELOW = 0.7
# a batch size the prediction keeps plain still takes a tree step now and then (the accept length is measured on
# tree steps only, so it would never see the traffic turn copy-heavy), spending at most this share of its time
PROBE_SHARE, MIN_PROBE_INTERVAL = 0.01, 16
# the same for a batch size predicted to lose by less (warm plain steps): a probe there costs little and a
# prediction near even is worth checking against the traffic more often
BAND_PROBE_SHARE = 0.05
# predicted speedup (at the learnt accept length) above which trees are taken without the measured switch's verdict:
# at one request a verdict weighs WINDOW steps, and a copy-heavy workload's accept length comes in bursts, so
# windows of a workload where trees win by 1.2-1.9x still lost often enough to spend a third of the steps plain
# (CPU bed, extraction at concurrency 1: auto 1.14x against the fixed tree's 1.23x, the prediction 1.2-1.9x
# throughout); the prediction's scales are served steps' own times, so its error is the accept length's
TRUSTED_WIN = 1.2
SMOOTHING = 0.3  # weight of the newest step in the scales' moving averages
# weight of each request of the newest tree step in the accept length's moving average (a batch of 16 weighs
# 1 - 0.9 ** 16 = 81%, one request 10%: one request's step, anywhere from 1 to the tree's depth, is noise)
ACCEPT_SMOOTHING = 0.1
# a request's own accept length is the mean of its tree steps, the traffic's average counted as REQUEST_PRIOR_STEPS
# steps, until the newest step's weight falls to REQUEST_SMOOTHING (then a moving average, so a long answer that
# stops copying is followed). Faster than the traffic's: one request stays copy-heavy (or not) for its whole answer,
# while the traffic's average carries earlier requests (the server's warm-up, another workload), which held one
# request's copy-heavy trees below the clear-win line for a dozen steps (CPU bed, extraction at concurrency 1:
# learnt 1.5-1.7 while its trees accepted 2.5 a step); a mean, not a fast moving average, because one request's
# copies come in bursts (a window of four steps may accept nothing)
REQUEST_PRIOR_STEPS, REQUEST_SMOOTHING = 2, 0.1
_SPARE_REQUESTS = 256  # per-request averages kept beyond the batch's before the finished ones are dropped
PRIOR_ACCEPT_LENGTH = 2.0  # tokens a request gains per tree step before any tree step ran
TREE, PLAIN, COLD = "tree", "plain", "cold"  # the kinds of step ``decide`` returns


@dataclass(frozen=True)
class StepCosts:
    """Start-up seconds of the target's verify forward for a decode batch, by batch size (requests):
    plain[b] at one token per request, tree[b] at ``tokens`` per request (the tree, root included)."""

    plain: dict[int, float]
    tree: dict[int, float]
    tokens: int

    def __post_init__(self) -> None:
        if not self.plain or set(self.plain) != set(self.tree):
            raise ValueError("plain and tree need the same non-empty batch sizes")
        if min(self.plain.values()) <= 0 or min(self.tree.values()) <= 0:
            raise ValueError("step costs must be positive seconds")

    def plain_at(self, batch_size: int) -> float:
        return interpolate_seconds(self.plain, batch_size)

    def tree_at(self, batch_size: int) -> float:
        return interpolate_seconds(self.tree, batch_size)

    def describe(self) -> str:
        """One log line: tree over plain forward time per batch size."""
        return ", ".join(f"{size}: {self.tree[size] / self.plain[size]:.2f}x" for size in sorted(self.plain))


@dataclass
class BatchSwitches:
    """The prediction (``costs`` and the served scales) and one SpeculationSwitch per batch-size bucket."""

    costs: StepCosts | None = None
    accept_length: float = PRIOR_ACCEPT_LENGTH  # tokens a request gains per tree step (moving average by request)
    request_accept: dict[str, float] = field(default_factory=dict)  # rid -> its own accept length (see above)
    request_steps: dict[str, int] = field(default_factory=dict)  # rid -> its tree steps learnt from
    judged: dict[int, frozenset[str]] = field(default_factory=dict)  # per bucket, the requests of its last step
    plain_scale: float = 1.0  # served plain step seconds over costs.plain_at (moving average)
    tree_scale: float = 1.0  # served tree step seconds over costs.tree_at (moving average)
    # the same per batch-size bucket, from its own tree steps (the first sets it): a tree step's drafting and host
    # work grow with the batch faster than the table's verify (CPU bed, chat at 16: ~8x a plain step served against
    # 3.4-3.8x in the table), and the shared scale is learnt mostly from small batches' tree steps
    bucket_tree_scale: dict[int, float] = field(default_factory=dict)
    switches: dict[int, SpeculationSwitch] = field(default_factory=dict)
    plain_steps: int = 0  # steps decided plain so far (reported in the log and by tests)
    tree_steps: int = 0
    since_tree: dict[int, int] = field(default_factory=dict)  # per bucket, plain steps by prediction since a tree
    logged: dict[int, bool] = field(default_factory=dict)  # per bucket, whether the last log line said plain
    cold_admissions: int = 0  # requests whose prompt the head skipped (``admit``)

    def switch(self, batch_size: int) -> SpeculationSwitch:
        bucket = batch_bucket(batch_size)
        if bucket not in self.switches:
            prior = _NO_PRIOR if self.costs is None else self.plain_scale * self.costs.plain_at(bucket) / bucket
            self.switches[bucket] = SpeculationSwitch(plain_seconds=prior, window=WINDOW, probe_steps=PROBE_STEPS)
        return self.switches[bucket]

    def batch_accept_length(self, rids: Sequence[str] | None = None) -> float:
        """The mean of the requests' own accept lengths (the traffic's for a request not seen in a tree step yet);
        the traffic's without ``rids``."""
        if not rids:
            return self.accept_length
        return math.fsum(self.request_accept.get(rid, self.accept_length) for rid in rids) / len(rids)

    def predicted_speedup(self, batch_size: int, floor: bool = False,
                          rids: Sequence[str] | None = None) -> float | None:
        """Tree over plain tokens per second for a batch of ``batch_size`` (the requests ``rids``, when given);
        None without start-up costs. Until ``WINDOW`` tree steps ran, or with ``floor``, the accept length is at
        least the prior (one odd first request, such as the server's warm-up, does not turn trees off)."""
        if self.costs is None:
            return None
        learnt = self.tree_steps >= WINDOW and not floor
        accept_length = self.batch_accept_length(rids)
        accept_length = accept_length if learnt else max(accept_length, PRIOR_ACCEPT_LENGTH)
        plain = self.plain_scale * self.costs.plain_at(batch_size)
        return accept_length * plain / (self.tree_scale_at(batch_size) * self.costs.tree_at(batch_size))

    def tree_scale_at(self, batch_size: int) -> float:
        """Served over start-up tree step time for this batch size's bucket; the traffic's until it took a tree
        step."""
        return self.bucket_tree_scale.get(batch_bucket(batch_size), self.tree_scale)

    def regime(self, batch_size: int, rids: Sequence[str] | None = None) -> str:
        """What the prediction alone makes of a batch of ``batch_size``: TREE, PLAIN (a loss predicted from the
        learnt accept length, above ``COLD_BELOW`` at the prior) or COLD (a clear loss even at the prior)."""
        predicted = self.predicted_speedup(batch_size, floor=True, rids=rids)
        if predicted is None:
            return TREE
        if predicted < COLD_BELOW:
            return COLD
        if batch_size == 1 or self.tree_steps < WINDOW:  # one request: the measured switch alone (see above)
            return TREE
        learnt = self.predicted_speedup(batch_size, rids=rids)
        return PLAIN if learnt is not None and learnt < 1.0 else TREE

    def decide(self, batch_size: int, rids: Sequence[str] | None = None, warm: int | None = None) -> str:
        """The next step of a batch of ``batch_size`` requests (``rids``, when known; ``warm`` of them never took a
        cold step, None: all): TREE, PLAIN (a measured or predicted loss: trees come back, so the head's KV is kept
        warm) or COLD (a clear loss by prediction: no head forward). A batch size the prediction keeps plain or
        cold takes a tree step now and then (a probe), priced per request it teaches: only warm requests teach the
        accept length, so the interval grows by ``batch_size / warm`` and an all-cold batch never probes."""
        self._forget_left_traffic(batch_size, rids)
        if self.clear_win(batch_size, rids):
            return TREE
        if self.switch(batch_size).lean:
            return PLAIN
        regime = self.regime(batch_size, rids)
        if regime == TREE:
            return TREE
        share = PROBE_SHARE if regime == COLD else BAND_PROBE_SHARE
        warm = batch_size if warm is None else warm
        if warm <= 0:
            return regime
        interval = self.probe_interval(batch_size, share * warm / batch_size)
        probe = self.since_tree.get(batch_bucket(batch_size), 0) >= interval
        return TREE if probe else regime

    def admit(self, requests: int, batch_size: int) -> bool:
        """``requests`` prompts are about to be prefilled into a decode batch of ``batch_size``: True where that
        batch is cold by prediction (``regime``), so the head's pass over their prompts would fill KV that no tree
        reads while the batch stays that large; they are then cold from their first token (counted in
        ``cold_admissions``)."""
        if self.costs is None or self.regime(batch_size) != COLD:
            return False
        self.cold_admissions += requests
        return True

    def _forget_left_traffic(self, batch_size: int, rids: Sequence[str] | None) -> None:
        """A batch with none of the requests of its bucket's last step is new traffic: the measured switch's verdict
        (and the plain stretch it bought) was about requests that have left, so it goes (at one request: each new
        request is judged on its own trees, as the reference decoder's per-request switch judges it)."""
        if not rids:
            return
        bucket = batch_bucket(batch_size)
        last = self.judged.get(bucket)
        if last is not None and last.isdisjoint(rids) and bucket in self.switches:
            self.switches[bucket].forget_verdict()
        self.judged[bucket] = frozenset(rids)

    def clear_win(self, batch_size: int, rids: Sequence[str] | None = None) -> bool:
        """Trees predicted to win by ``TRUSTED_WIN`` or more at the learnt accept length (``WINDOW`` tree steps
        ran): taken whatever the measured switch's last verdict, which does not see these steps."""
        if self.tree_steps < WINDOW:
            return False
        predicted = self.predicted_speedup(batch_size, rids=rids)
        return predicted is not None and predicted >= TRUSTED_WIN

    def probe_interval(self, batch_size: int, share: float = PROBE_SHARE) -> int:
        """Plain steps between two tree steps of a batch size the prediction keeps plain: a tree step costs
        (tree / plain - 1) plain steps more than a plain one, and probes take ``share`` of the time at most."""
        assert self.costs is not None
        plain = self.plain_scale * self.costs.plain_at(batch_size)
        extra = self.tree_scale_at(batch_size) * self.costs.tree_at(batch_size) / plain
        return max(math.ceil(round((extra - 1) / share, 6)), MIN_PROBE_INTERVAL)  # round: float noise

    def observe(self, batch_size: int, plain: bool, seconds: float, tokens: int, warm_requests: int | None = None,
                warm_tokens: int = 0, rids: Sequence[str] | None = None,
                request_tokens: Mapping[str, int] | None = None) -> str | None:
        """A step of ``batch_size`` requests (``rids``, when known) took ``seconds`` and emitted ``tokens`` (a
        plain step: one a request); ``warm_requests`` of them (None: all) never took a cold step and emitted
        ``warm_tokens``: only they teach the accept length. ``request_tokens`` (rid -> tokens, the warm requests
        only) gives the same by request and teaches each its own. Returns a line for the log when the batch size
        turns speculation off or back on."""
        if request_tokens is not None:
            warm_requests, warm_tokens = len(request_tokens), sum(request_tokens.values())
        switch = self.switch(batch_size)
        if plain:
            self.plain_steps += 1
            if not switch.lean:  # a plain step by prediction
                self.since_tree[batch_bucket(batch_size)] = self.since_tree.get(batch_bucket(batch_size), 0) + 1
            switch.observe_plain(seconds / max(batch_size, 1))
            if self.costs is not None:
                self.plain_scale = moving_average(self.plain_scale, seconds / self.costs.plain_at(batch_size))
        else:
            clear = self.clear_win(batch_size, rids)  # before this step moves the prediction: what decided it
            self.tree_steps += 1
            self.since_tree[batch_bucket(batch_size)] = 0
            if not clear:
                switch.observe_speculative(seconds, tokens)
            if warm_requests is None:
                warm_requests, warm_tokens = batch_size, tokens
            if request_tokens:
                self._learn_requests(request_tokens, rids or ())
            if warm_requests > 0:
                kept = (1 - ACCEPT_SMOOTHING) ** warm_requests
                self.accept_length = kept * self.accept_length + (1 - kept) * warm_tokens / warm_requests
            if self.costs is not None:
                scale = seconds / self.costs.tree_at(batch_size)
                self.tree_scale = moving_average(self.tree_scale, scale)
                bucket = batch_bucket(batch_size)
                self.bucket_tree_scale[bucket] = moving_average(self.bucket_tree_scale.get(bucket, scale), scale)
        # probes aside: they change no state
        now_plain = not self.clear_win(batch_size, rids) and (switch.lean or self.regime(batch_size, rids) != TREE)
        if now_plain == self.logged.get(batch_bucket(batch_size), False):
            return None
        self.logged[batch_bucket(batch_size)] = now_plain
        predicted = self.predicted_speedup(batch_size, rids=rids)
        why = "" if predicted is None else f"predicted {predicted:.2f}x, "
        state = "plain" if now_plain else "trees"
        return (f"tree auto, batches up to {batch_bucket(batch_size)}: {state} ({why}accept length "
                f"{self.batch_accept_length(rids):.2f}, plain decoding {switch.plain_rate():.4f} s/token; "
                f"{self.tree_steps} tree / {self.plain_steps} plain steps so far)")

    def _learn_requests(self, request_tokens: Mapping[str, int], rids: Sequence[str]) -> None:
        """Each warm request's own accept length (``REQUEST_PRIOR_STEPS``, ``REQUEST_SMOOTHING``), from the
        traffic's before its first tree step; finished requests are forgotten once ``_SPARE_REQUESTS`` more than
        the batch are held."""
        for rid, tokens in request_tokens.items():
            old = self.request_accept.get(rid, self.accept_length)
            steps = self.request_steps.get(rid, 0) + 1
            weight = max(1 / (steps + REQUEST_PRIOR_STEPS), REQUEST_SMOOTHING)
            self.request_accept[rid] = (1 - weight) * old + weight * tokens
            self.request_steps[rid] = steps
        if len(self.request_accept) > len(rids) + len(request_tokens) + _SPARE_REQUESTS:
            alive = {*rids, *request_tokens}
            self.request_accept = {rid: value for rid, value in self.request_accept.items() if rid in alive}
            self.request_steps = {rid: steps for rid, steps in self.request_steps.items() if rid in alive}


def moving_average(old: float, new: float) -> float:
    """``old`` moved towards ``new`` by ``SMOOTHING`` (the weight of the newest step)."""
    return (1 - SMOOTHING) * old + SMOOTHING * new


def batch_bucket(batch_size: int) -> int:
    """The next power of two at or above the batch size."""
    return 1 << max(batch_size - 1, 0).bit_length()
