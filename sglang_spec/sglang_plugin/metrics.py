"""Per-position acceptance, exported beside SGLang's own speculative metrics.

SGLang reports the mean accept length; trees also need to know where along the path acceptance fails. For every
verify step of every request SGLang records the number of accepted drafts (``Req.update_spec_correct_drafts_
histogram``); the plugin counts, per draft position d, how many steps accepted at least d drafts:
``sglang_spec_tree_accepted_drafts_total{position="d"}`` over ``sglang_spec_tree_verify_steps_total`` is the
acceptance rate at position d, and 1 + sum_d of those rates is the mean accept length.

Per (depth, rank): ``sglang_spec_tree_rank_{offered,accepted}_total{depth,rank}`` and
``sglang_spec_tree_rank_steps_total`` count, at every accepted node, its children offered and the accepted one
(``RankMetrics``, accumulated on the device; ``sglang-spec calibrate --from-server`` reads them).

Per source (lookup / hybrid trees): ``sglang_spec_source_{offered,accepted}_total{cell}`` count the outcomes the
context drafter observed online, by ``SourceCounts`` cell name (``SourceMetrics``; ``calibrate --from-server``
turns them into a profile's ``sources`` section).

With ``--speculative-tree-accept fused``, ``sglang_spec_fused_accept_batches_total{outcome}`` counts the verify
batches the fused accept served (``outcome="fused"``) and those it left to SGLang's own path, by reason.

Per head (a draft head swapped in place, ``sglang-spec adapt``): ``sglang_spec_head_version`` is the number of
swaps since launch (0: the launch head), ``sglang_spec_head_swaps_total{head}`` counts the swaps to each head label
(a rollback swaps back to an earlier label), and ``sglang_spec_head_verify_steps_total{head}`` /
``sglang_spec_head_accepted_drafts_total{head}`` count the verify steps drafted with each head and their accepted
drafts: 1 + accepted / steps is a head's mean accept length. The launch head is labelled ``0``.

With ``--speculative-tree-auto``, ``sglang_spec_planner_verify_tokens`` (a histogram, one observation per request
per decode step) gives the verify size the planner chose, ``sglang_spec_planner_plain_requests_total`` over
``sglang_spec_planner_requests_total`` the share of requests it decoded plainly,
``sglang_spec_planner_{predicted,served}_seconds_total`` its predicted against its served step time, and
``sglang_spec_planner_head_{rested,warmup}_steps_total`` the plain steps that left the head's draft extend out and
the trees taken as a plain step to run it (``PlannerMetrics``).

Where steps verify ragged (each request's forward covers its own tree), ``sglang_spec_verify_tokens_computed_total``
over ``sglang_spec_verify_tokens_dense_total`` is the share of SGLang's fixed-width verify tokens the forwards
computed (``VerifyTokenMetrics``).

``sglang_spec_draft_faults_total{error}`` counts the batches whose draft raised inside the plugin and were verified
without speculation instead (``hooks.draft.draft_forward_around``), by exception type;
``sglang_spec_accept_faults_total{stage,error}`` the faults in the plugin's accept and its other per-batch and
per-request hooks (``faults.accept_fault``, ``faults.plugin_fault``), by stage (``faults``: accept, commit, record,
observe, counts, auto, penalties, ragged; request_check, counted in the tokenizer manager's process) and exception type.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from sglang_spec.train.server_counts import LAUNCH_HEAD

MAX_POSITIONS = 64


@dataclass(frozen=True)
class _AcceptanceCounters:
    """The prometheus_client counters ``AcceptanceMetrics`` feeds once registered."""

    steps: Any
    accepted: Any  # labelled by position
    accept_outcomes: Any  # labelled by outcome
    draft_faults: Any  # labelled by error
    accept_faults: Any  # labelled by stage and error
    head_version: Any  # a gauge: swaps since launch
    head_swaps: Any  # labelled by head
    head_steps: Any  # labelled by head
    head_accepted: Any  # labelled by head


class AcceptanceMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps = 0
        self.accepted = [0] * (MAX_POSITIONS + 1)
        self.accept_outcomes: Counter[str] = Counter()
        self.draft_faults: Counter[str] = Counter()
        self.accept_faults: Counter[tuple[str, str]] = Counter()
        # the served head's label and, per label, (verify steps, accepted drafts) drafted with it
        self.head = LAUNCH_HEAD
        self.head_version = 0
        self.by_head: dict[str, list[int]] = {LAUNCH_HEAD: [0, 0]}
        self._prometheus: _AcceptanceCounters | None = None
        # False on attention-TP ranks other than 0: they verify the same requests, and counting there too would
        # multiply every total by the TP size (set at worker start-up, hooks.draft.claim_acceptance_metrics)
        self.counting = True

    def record(self, num_correct_drafts: int) -> None:
        if not self.counting:
            return
        num_correct_drafts = max(0, min(int(num_correct_drafts), MAX_POSITIONS))
        with self._lock:
            self.steps += 1
            for position in range(1, num_correct_drafts + 1):
                self.accepted[position] += 1
            head = self.head
            counts = self.by_head[head]
            counts[0] += 1
            counts[1] += num_correct_drafts
        if self._prometheus is not None:
            self._prometheus.steps.inc()
            for position in range(1, num_correct_drafts + 1):
                self._prometheus.accepted.labels(position=str(position)).inc()
            self._prometheus.head_steps.labels(head=head).inc()
            if num_correct_drafts:
                self._prometheus.head_accepted.labels(head=head).inc(num_correct_drafts)

    def set_head(self, version: int, label: str) -> None:
        """The draft head was swapped (``state.WorkerState.swap_head``): later steps count for ``label``."""
        with self._lock:
            self.head, self.head_version = label, version
            self.by_head.setdefault(label, [0, 0])
        if self._prometheus is not None and self.counting:
            self._prometheus.head_version.set(version)
            self._prometheus.head_swaps.labels(head=label).inc()
            self._prometheus.head_steps.labels(head=label).inc(0)  # the head's lines exist from the swap on
            self._prometheus.head_accepted.labels(head=label).inc(0)

    def head_accept_length(self, label: str) -> float | None:
        """The mean accept length of the steps drafted with head ``label`` (None before its first step)."""
        with self._lock:
            steps, accepted = self.by_head.get(label, (0, 0))
        return 1.0 + accepted / steps if steps else None

    def record_accept(self, outcome: str) -> None:
        """One verify batch: served by the fused accept (``"fused"``) or by SGLang's, with the reason."""
        if not self.counting:
            return
        with self._lock:
            self.accept_outcomes[outcome] += 1
        if self._prometheus is not None:
            self._prometheus.accept_outcomes.labels(outcome=outcome).inc()

    def record_draft_fault(self, error: str, count: int = 1) -> None:
        """``count`` drafts (a batch whose draft raised ``error``, an exception type name; or requests of the own
        loop whose head output was not finite, ``head_guard``) that went on without speculation."""
        if not self.counting:
            return
        with self._lock:
            self.draft_faults[error] += count
        if self._prometheus is not None:
            self._prometheus.draft_faults.labels(error=error).inc(count)

    def record_accept_fault(self, stage: str, error: str) -> None:
        """One fault raised at ``stage`` of the plugin's accept (an exception type name ``error``), recovered."""
        if not self.counting:
            return
        with self._lock:
            self.accept_faults[stage, error] += 1
        if self._prometheus is not None:
            self._prometheus.accept_faults.labels(stage=stage, error=error).inc()

    def rates(self) -> list[float]:
        """Acceptance rate per position 1, 2, ... (up to the deepest position seen)."""
        with self._lock:
            if not self.steps:
                return []
            deepest = max((p for p in range(1, MAX_POSITIONS + 1) if self.accepted[p]), default=0)
            return [self.accepted[p] / self.steps for p in range(1, deepest + 1)]

    def mean_accept_length(self) -> float:
        return 1.0 + sum(self.rates())

    def enable_prometheus(self) -> None:
        """Registers the counters with prometheus_client (SGLang's metrics registry in this process)."""
        if self._prometheus is not None:
            return
        from prometheus_client import Counter as PrometheusCounter
        from prometheus_client import Gauge

        steps = PrometheusCounter("sglang_spec_tree_verify_steps_total", "verify steps, one per request per step")
        accepted = PrometheusCounter("sglang_spec_tree_accepted_drafts_total",
                           "verify steps that accepted at least `position` drafts", ["position"])
        outcomes = PrometheusCounter("sglang_spec_fused_accept_batches_total",
                           "verify batches by who accepted them: fused, or SGLang's path and why", ["outcome"])
        faults = PrometheusCounter("sglang_spec_draft_faults_total",
                                   "batches whose draft raised in the plugin and were verified without speculation",
                                   ["error"])
        accept_faults = PrometheusCounter("sglang_spec_accept_faults_total",
                                          "faults in the plugin's accept, recovered (the batch accepted by SGLang's "
                                          "path, or its bookkeeping skipped)", ["stage", "error"])
        # the scheduler's value (SGLang's registry is multiprocess: "livemax" keeps one line, the live ranks' max)
        head_version = Gauge("sglang_spec_head_version", "draft head swaps since launch (0: the launch head)",
                             multiprocess_mode="livemax")
        head_swaps = PrometheusCounter("sglang_spec_head_swaps", "draft head swaps to each head label", ["head"])
        head_steps = PrometheusCounter("sglang_spec_head_verify_steps", "verify steps drafted with each head",
                                       ["head"])
        head_accepted = PrometheusCounter("sglang_spec_head_accepted_drafts",
                                          "accepted drafts of the verify steps drafted with each head", ["head"])
        head_version.set(self.head_version)
        head_steps.labels(head=self.head).inc(0)
        head_accepted.labels(head=self.head).inc(0)
        self._prometheus = _AcceptanceCounters(steps, accepted, outcomes, faults, accept_faults, head_version,
                                               head_swaps, head_steps, head_accepted)


METRICS = AcceptanceMetrics()


class PlannerMetrics:
    """Tree auto's choices (host counts; Prometheus once enabled, attention-TP rank 0 with ``--enable-metrics``):
    ``steps`` by verify size, requests decoded in all and plainly, predicted and served step seconds, plain steps
    that left the head's draft extend out (``head_rested``) and trees taken as a plain step that ran it
    (``head_warmups``; ``step_planner``, the head at rest)."""

    def __init__(self) -> None:
        self.steps: Counter[int] = Counter()
        self.requests = 0
        self.plain_requests = 0
        self.predicted_seconds = 0.0
        self.served_seconds = 0.0
        self.head_rested = 0
        self.head_warmups = 0
        self._prometheus: tuple[Any, ...] | None = None

    def enable_prometheus(self) -> None:
        if self._prometheus is not None:
            return
        from prometheus_client import Counter as PrometheusCounter
        from prometheus_client import Histogram

        self._prometheus = (
            Histogram("sglang_spec_planner_verify_tokens", "verify tokens a request per decode step (root included)",
                      buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)),
            PrometheusCounter("sglang_spec_planner_requests", "requests decoded under tree auto, one per step"),
            PrometheusCounter("sglang_spec_planner_plain_requests", "requests the planner decoded plainly"),
            PrometheusCounter("sglang_spec_planner_predicted_seconds", "the planned steps' predicted seconds"),
            PrometheusCounter("sglang_spec_planner_served_seconds", "the planned steps' served seconds"),
            PrometheusCounter("sglang_spec_planner_head_rested_steps",
                              "plain steps that left the head's draft extend out"),
            PrometheusCounter("sglang_spec_planner_head_warmup_steps",
                              "trees the planner chose taken as a plain step that ran the head's draft extend"),
        )

    def record(self, tokens: int, verify_tokens: Sequence[int], predicted: float, served: float,
               head_rested: bool = False, head_warmup: bool = False) -> None:
        """One decode step of verify size ``tokens``, each request's planned verify tokens ``verify_tokens`` (root
        included; 1: the request decoded plainly, in a plain step or, ragged, beside others' trees); predicted and
        served seconds; whether it left the head's draft extend out, whether it was a tree taken plain to run it."""
        if not METRICS.counting:
            return
        plain_requests = sum(1 for count in verify_tokens if count == 1)
        self.steps[tokens] += 1
        self.requests += len(verify_tokens)
        self.plain_requests += plain_requests
        self.predicted_seconds += predicted
        self.served_seconds += served
        self.head_rested += int(head_rested)
        self.head_warmups += int(head_warmup)
        if self._prometheus is not None:
            histogram, total, plain, predicted_total, served_total, rested, warmups = self._prometheus
            for count in verify_tokens:
                histogram.observe(count)
            total.inc(len(verify_tokens))
            if plain_requests:
                plain.inc(plain_requests)
            predicted_total.inc(predicted)
            served_total.inc(served)
            if head_rested:
                rested.inc()
            if head_warmup:
                warmups.inc()


PLANS = PlannerMetrics()


class VerifyTokenMetrics:
    """Tokens the target's verify forwards computed on a server whose steps verify ragged (``ragged_verify``)
    against the tokens SGLang's fixed width would have computed for the same steps (host counts; Prometheus once
    enabled, attention-TP rank 0 with ``--enable-metrics``)."""

    def __init__(self) -> None:
        self.computed = 0
        self.dense = 0
        self._prometheus: tuple[Any, Any] | None = None

    def enable_prometheus(self) -> None:
        if self._prometheus is not None:
            return
        from prometheus_client import Counter as PrometheusCounter

        self._prometheus = (
            PrometheusCounter("sglang_spec_verify_tokens_computed", "tokens the verify forwards computed"),
            PrometheusCounter("sglang_spec_verify_tokens_dense",
                              "tokens the same verify forwards would compute at SGLang's fixed width"))

    def record(self, computed: int, dense: int) -> None:
        if not METRICS.counting:
            return
        self.computed += computed
        self.dense += dense
        if self._prometheus is not None:
            self._prometheus[0].inc(computed)
            self._prometheus[1].inc(dense)


VERIFY_TOKENS = VerifyTokenMetrics()


# ------------------------------------------------------------------------------------------- per-rank acceptance
MAX_RANKS = 16
FLUSH_SECONDS = 1.0


def tree_rank_counts(next_token, next_sibling, accept_index, max_depth: int = MAX_POSITIONS,
                     max_rank: int = MAX_RANKS):
    """One verify batch's (offered, accepted) counts per (depth, rank), as two int64 tensors [max_depth + 1,
    max_rank] on the batch's device (no host sync). ``next_token`` / ``next_sibling``: SGLang's
    ``retrieve_next_token`` / ``retrieve_next_sibling`` ([bs, n] local node indices, -1 for none; node 0 is the
    root); ``accept_index``: eagle_sample's [bs, S + 1] accepted path as global node indices (b * n + j), -1 padded.

    A node is offered when its parent is on the accepted path; its depth is its parent's position on the path + 1,
    its rank its position in the parent's sibling chain (SGLang links siblings in draft-slot order, which is the
    head's top-k rank order). Row 0 counts the verify steps (the root, offered and accepted once per request).
    Nodes deeper than ``max_depth`` or ranked at ``max_rank`` or beyond are not counted."""
    bs = accept_index.shape[0]
    device = accept_index.device
    next_token = next_token.reshape(bs, -1).long()
    n = next_token.shape[1]
    pad = torch.full((bs, 1), -1, dtype=torch.long, device=device)
    next_sibling = torch.cat([next_sibling.reshape(bs, n).long(), pad], 1)  # column n: the dump slot
    nodes = torch.arange(n, device=device).expand(bs, n)
    parent = torch.full((bs, n + 1), -1, dtype=torch.long, device=device)
    rank = torch.zeros((bs, n + 1), dtype=torch.long, device=device)
    current = next_token  # for every node, the child of its chain reached after k siblings
    for k in range(n - 1):
        target = torch.where(current >= 0, current, n)
        parent.scatter_(1, target, nodes)
        rank.scatter_(1, target, torch.full_like(target, k))
        current = next_sibling.gather(1, target)
    parent[:, n] = -1
    path = accept_index.reshape(bs, -1).long()
    rows = torch.arange(bs, device=device)[:, None]
    local = torch.where(path >= 0, path - rows * n, n)
    position = torch.full((bs, n + 1), -1, dtype=torch.long, device=device)
    position.scatter_(1, local, torch.arange(path.shape[1], device=device).expand_as(local))
    position[:, n] = -1
    parent_position = position.gather(1, torch.where(parent[:, :n] >= 0, parent[:, :n], n))
    depth = parent_position + 1
    node_rank = rank[:, :n]
    offered = (parent[:, :n] >= 0) & (parent_position >= 0) & (depth <= max_depth) & (node_rank < max_rank)
    accepted = offered & (position[:, :n] >= 0)
    index = torch.where(offered, depth * max_rank + node_rank, 0).reshape(-1)
    counts = torch.zeros((2, (max_depth + 1) * max_rank), dtype=torch.long, device=device)
    counts[0].scatter_add_(0, index, offered.reshape(-1).long())
    counts[1].scatter_add_(0, index, accepted.reshape(-1).long())
    roots = (path[:, 0] >= 0).long().sum()
    counts[:, 0] += roots
    return counts[0].view(max_depth + 1, max_rank), counts[1].view(max_depth + 1, max_rank)


class RankMetrics:
    """Per-(depth, rank) (offered, accepted) counts of the head's draft nodes at accepted nodes, accumulated on the
    device; copied to the host (one sync) at most once a second on a GPU, every step on a CPU, and then added to
    the Prometheus counters ``sglang_spec_tree_rank_{offered,accepted}_total{depth,rank}`` and
    ``sglang_spec_tree_rank_steps_total`` (what ``sglang-spec calibrate --from-server`` reads)."""

    def __init__(self) -> None:
        self.enabled = False
        self._lock = threading.Lock()
        self._device_counts = None  # int64 [2, depth + 1, rank]
        self.host = None  # the last flushed copy
        self._last_flush = 0.0
        self._prometheus = None

    def enable(self, prometheus: bool) -> None:
        self.enabled = True
        if prometheus and self._prometheus is None:
            from prometheus_client import Counter as PrometheusCounter

            self._prometheus = (
                PrometheusCounter("sglang_spec_tree_rank_steps", "verify steps counted per rank, one per request"),
                PrometheusCounter("sglang_spec_tree_rank_offered", "draft nodes offered at an accepted node",
                                  ["depth", "rank"]),
                PrometheusCounter("sglang_spec_tree_rank_accepted", "offered draft nodes that were accepted",
                                  ["depth", "rank"]),
            )

    def record(self, next_token, next_sibling, accept_index) -> None:
        offered, accepted = tree_rank_counts(next_token, next_sibling, accept_index)
        with self._lock:
            step = torch.stack([offered, accepted])
            self._device_counts = step if self._device_counts is None else self._device_counts + step
            now = time.monotonic()
            if step.device.type != "cpu" and now - self._last_flush < FLUSH_SECONDS:
                return
            self._last_flush = now
            self._flush()

    def _flush(self) -> None:
        current = self._device_counts.cpu()  # the one host read
        previous = self.host
        self.host = current
        if self._prometheus is None:
            return
        delta = current if previous is None else current - previous
        steps, offered, accepted = self._prometheus
        if int(delta[0, 0, 0]):
            steps.inc(int(delta[0, 0, 0]))
        for kind, counter in ((0, offered), (1, accepted)):
            for depth, rank in delta[kind, 1:].nonzero().tolist():
                counter.labels(depth=str(depth + 1), rank=str(rank)).inc(int(delta[kind, depth + 1, rank]))


RANKS = RankMetrics()


class SourceMetrics:
    """The per-source outcomes a context drafter observed (host counts, added once per draft step) as Prometheus
    counters ``sglang_spec_source_{offered,accepted}_total{cell}``; off unless enabled (attention-TP rank 0 with
    ``--enable-metrics``)."""

    def __init__(self) -> None:
        self.enabled = False
        self._counters = None

    def enable(self) -> None:
        from prometheus_client import Counter as PrometheusCounter

        self.enabled = True
        if self._counters is None:
            self._counters = (
                PrometheusCounter("sglang_spec_source_offered", "candidates offered at an accepted node", ["cell"]),
                PrometheusCounter("sglang_spec_source_accepted", "offered candidates that were accepted", ["cell"]),
            )

    def add(self, observed: dict[str, tuple[float, float]]) -> None:
        """observed: cell name -> (accepted, offered) outcomes since the last call."""
        if self._counters is None:
            return
        offered, accepted = self._counters
        for cell, (hits, offers) in observed.items():
            if offers:
                offered.labels(cell=cell).inc(offers)
            if hits:
                accepted.labels(cell=cell).inc(hits)


SOURCES = SourceMetrics()
