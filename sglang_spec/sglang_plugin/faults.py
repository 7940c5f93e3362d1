"""Faults in the plugin: how one is reported and recovered from, and the faults the tests raise on purpose.

A fault in one of the plugin's hooks on a request or a batch must not take SGLang's server down: the draft's batch
verifies a filler tree (``hooks.draft``), the accept's batch is accepted by SGLang's own path (``hooks.accept``),
a fault in tree auto's choice gives a plain step (``hooks.auto``), the per-node penalties give SGLang's own
(``hooks.accept``), a fault in the check of a request leaves it to SGLang's validation (``hooks.requests``). Each
is counted on ``/metrics`` and logged in one line (``accept_fault``, ``plugin_fault``; drafts: ``hooks.draft``).

The tests inject faults through launch_server with variables read once at start-up (``FaultInjection``); a
served deployment sets none of them and its workers carry no injection state:

* ``SGLANG_SPEC_INJECT_DRAFT_FAULT=n``: every n-th draft raises (under tensor parallelism once the draft ran);
  ``SGLANG_SPEC_INJECT_FAULT_RANK=r``: on attention-TP rank r only (the others then fall back with it).
* ``SGLANG_SPEC_INJECT_ACCEPT_FAULT=n``: every n-th verify step raises at one stage of the plugin's accept, the
  stages the server runs taken in turn (``AcceptFaults``).
* ``SGLANG_SPEC_INJECT_NONFINITE_HEAD=n``: every n-th head forward of the plugin's draft returns NaN
  probabilities for the batch's first request (``HeadPoison``; ``drafters.head_guard`` catches it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from sglang_spec.sglang_plugin.messages import StartupError, log
from sglang_spec.sglang_plugin.metrics import METRICS

# the plugin's accept, stage by stage (the ``stage`` label of sglang_spec_accept_faults_total)
ACCEPT = "accept"  # the fused accept's verify + accept kernels (--speculative-tree-accept fused)
COMMIT = "commit"  # the fused accept's KV commit
RECORD = "record"  # after the accept: the accepted paths handed to the context drafter, the rank counts
OBSERVE = "observe"  # at the next draft: the context drafter learns from the paths (lookup / hybrid)
COUNTS = "counts"  # per request, after the step: the per-position acceptance counts
AUTO = "auto"  # --speculative-tree-auto: the step's choice and its timing
RAGGED = "ragged"  # a draft's ragged verify: its fillers unlinked, its lengths for the forward (hooks.draft)
PENALTIES = "penalties"  # a penalised verify batch's penalties per tree node (hooks.accept)
HEAD_FAULTS = "head_faults"  # the count of requests drafted from a non-finite head output (hooks.draft)
HEAD_SKIP = "head_skip"  # the head's pass skipped where no tree reads it: SGLang's stub of its outputs (hooks.draft)
EXTEND_ROWS = "extend_rows"  # a decode step's draft extend: its LM head over each request's last accepted row only
REQUEST = "request_check"  # the tokenizer manager's check of a request (hooks.requests; counted in that process)

FAULT_ENV = "SGLANG_SPEC_INJECT_DRAFT_FAULT"
ACCEPT_FAULT_ENV = "SGLANG_SPEC_INJECT_ACCEPT_FAULT"
FAULT_RANK_ENV = "SGLANG_SPEC_INJECT_FAULT_RANK"
HEAD_POISON_ENV = "SGLANG_SPEC_INJECT_NONFINITE_HEAD"


class InjectedFault(RuntimeError):
    """A fault raised on purpose (``SGLANG_SPEC_INJECT_*``), for the fault-injection tests."""


class FaultOnAnotherRank(RuntimeError):
    """This rank's draft or fused accept went well, another rank's of its tensor-parallel group did not: every rank
    takes the fallback (the filler tree; SGLang's accept)."""


def capturing() -> bool:
    """Whether a CUDA graph is being captured: a fault then fails the capture rather than record a fallback."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def accept_fault(stage: str, error: Exception, batch_size: int, outcome: str) -> None:
    """One fault in the plugin's accept (raised at ``stage``) that the caller recovers from as ``outcome`` says:
    counted (sglang_spec_accept_faults_total), one log line. While a CUDA graph is being captured it raises
    instead (a capture must fail, not record a fallback)."""
    plugin_fault(stage, error, f"batch of {batch_size}", outcome, kind="accept fault")


def plugin_fault(stage: str, error: Exception, subject: str, outcome: str, kind: str = "fault") -> None:
    """One fault raised at ``stage`` of a plugin hook on ``subject`` ("batch of 3", "one request") that the caller
    recovers from as ``outcome`` says: counted (sglang_spec_accept_faults_total{stage}), one line ``{kind} in
    {stage}, {subject}: {outcome} (...)``. Raises ``error`` instead while a CUDA graph is being captured."""
    if capturing():
        raise error
    METRICS.record_accept_fault(stage, type(error).__name__)
    log(f"{kind} in {stage}, {subject}: {outcome} ({type(error).__name__}: {error}; sglang_spec_accept_faults_total)")


@dataclass
class AcceptFaults:
    """Injected accept faults of one worker: every ``every``-th verify step arms one of ``stages`` (in turn), and
    the first call of ``fire`` with that stage raises. A stage the step does not reach (a batch the fused accept
    leaves to SGLang, say) raises nothing; the next armed step moves on to the next stage."""

    every: int
    stages: tuple[str, ...]
    steps: int = 0  # verify steps seen
    injected: int = 0  # stages armed so far
    armed: str | None = None

    def arm(self) -> None:
        """At the start of a verify step."""
        self.armed = None
        if not self.every or not self.stages:
            return
        self.steps += 1
        if self.steps % self.every == 0:
            self.armed = self.stages[self.injected % len(self.stages)]
            self.injected += 1

    def fire(self, stage: str) -> None:
        if self.armed == stage:
            self.armed = None
            raise InjectedFault(f"verify step {self.steps}, {stage} (SGLANG_SPEC_INJECT_ACCEPT_FAULT={self.every})")


@dataclass
class HeadPoison:
    """Every ``every``-th head forward's probabilities turn NaN for the batch's first request."""

    every: int
    forwards: int = 0

    def apply(self, topk_p: torch.Tensor, batch: int) -> torch.Tensor:
        """``topk_p`` [batch * rows, k] (request-major), the first request's rows NaN on every ``every``-th call."""
        self.forwards += 1
        if self.forwards % self.every:
            return topk_p
        poisoned = topk_p.clone()
        poisoned[: topk_p.shape[0] // batch] = float("nan")
        return poisoned


@dataclass
class FaultInjection:
    """One worker's injected faults (tests). draft_every: every n-th draft raises (0: never), counted in ``drafts``;
    accept: the accept stages' (set by the target worker, over the stages its server runs); poison: the head's."""

    draft_every: int = 0
    drafts: int = 0
    accept: AcceptFaults | None = None
    poison: HeadPoison | None = None

    @classmethod
    def from_environment(cls, rank: int) -> FaultInjection | None:
        """The draft worker's injection on attention-TP rank ``rank``, None when no variable asks for one. A bad
        value ends the launch in one line."""
        poison_every = _whole_number(HEAD_POISON_ENV, "every n-th head forward of the plugin's draft returns NaN "
                                                      "probabilities")
        draft_every = _whole_number(FAULT_ENV, "every n-th draft raises") if _injects_on(rank) else 0
        if not draft_every and not poison_every:
            return None
        return cls(draft_every=draft_every, poison=HeadPoison(poison_every) if poison_every else None)

    def draft_due(self) -> bool:
        """Counts a draft; whether it is one to fail."""
        self.drafts += 1
        return bool(self.draft_every) and self.drafts % self.draft_every == 0

    def arm_accept(self, rank: int, stages: tuple[str, ...]) -> None:
        """The target worker's accept faults over ``stages``, where asked for on this rank."""
        every = _whole_number(ACCEPT_FAULT_ENV, "every n-th verify step's accept raises")
        if every and _injects_on(rank):
            self.accept = AcceptFaults(every, stages)

    def fire_accept(self, stage: str) -> None:
        if self.accept is not None:
            self.accept.fire(stage)


def _whole_number(name: str, what: str) -> int:
    text = os.environ.get(name, "0")
    if not text.isdigit():
        raise StartupError(f"{name}={text!r}: give a whole number n ({what}) or 0")
    return int(text)


def _injects_on(rank: int) -> bool:
    """Whether this attention-TP rank injects draft and accept faults (``SGLANG_SPEC_INJECT_FAULT_RANK``: one rank;
    unset: every rank)."""
    text = os.environ.get(FAULT_RANK_ENV, "").strip()
    if not text:
        return True
    if not text.isdigit():
        raise StartupError(f"{FAULT_RANK_ENV}={text!r}: give the tensor-parallel rank that injects faults, or unset it")
    return int(text) == rank

