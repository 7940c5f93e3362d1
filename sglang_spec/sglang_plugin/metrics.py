"""Per-position acceptance, exported beside SGLang's own speculative metrics.

SGLang reports the mean accept length; trees also need to know where along the path acceptance fails. For every
verify step of every request SGLang records the number of accepted drafts (``Req.update_spec_correct_drafts_
histogram``); the plugin counts, per draft position d, how many steps accepted at least d drafts:
``sglang_spec_tree_accepted_drafts_total{position="d"}`` over ``sglang_spec_tree_verify_steps_total`` is the
acceptance rate at position d, and 1 + sum_d of those rates is the mean accept length.

With ``--speculative-tree-accept fused``, ``sglang_spec_fused_accept_batches_total{outcome}`` counts the verify
batches the fused accept served (``outcome="fused"``) and those it left to SGLang's own path, by reason.
"""

from __future__ import annotations

import threading
from collections import Counter

MAX_POSITIONS = 64


class AcceptanceMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps = 0
        self.accepted = [0] * (MAX_POSITIONS + 1)
        self.accept_outcomes: Counter[str] = Counter()
        self._prometheus = None

    def record(self, num_correct_drafts: int) -> None:
        num_correct_drafts = max(0, min(int(num_correct_drafts), MAX_POSITIONS))
        with self._lock:
            self.steps += 1
            for position in range(1, num_correct_drafts + 1):
                self.accepted[position] += 1
        if self._prometheus is not None:
            steps, accepted, _ = self._prometheus
            steps.inc()
            for position in range(1, num_correct_drafts + 1):
                accepted.labels(position=str(position)).inc()

    def record_accept(self, outcome: str) -> None:
        """One verify batch: served by the fused accept (``"fused"``) or by SGLang's, with the reason."""
        with self._lock:
            self.accept_outcomes[outcome] += 1
        if self._prometheus is not None:
            self._prometheus[2].labels(outcome=outcome).inc()

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

        steps = PrometheusCounter("sglang_spec_tree_verify_steps_total", "verify steps, one per request per step")
        accepted = PrometheusCounter("sglang_spec_tree_accepted_drafts_total",
                           "verify steps that accepted at least `position` drafts", ["position"])
        outcomes = PrometheusCounter("sglang_spec_fused_accept_batches_total",
                           "verify batches by who accepted them: fused, or SGLang's path and why", ["outcome"])
        self._prometheus = (steps, accepted, outcomes)


METRICS = AcceptanceMetrics()
