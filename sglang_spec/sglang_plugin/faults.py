"""Faults raised on purpose inside the plugin, for the tests that prove they fail safe (``hooks``).

A fault in the plugin's draft or accept for one batch must not take SGLang's scheduler down: the draft's batch
verifies a filler tree, the accept's batch is accepted by SGLang's own path (``hooks``, ``docs/sglang-plugin.md``
"Faults"). The tests inject them through launch_server with two variables, read once at start-up:

* ``SGLANG_SPEC_INJECT_DRAFT_FAULT=n``: every n-th draft raises (``hooks.draft_forward_around``; under tensor
  parallelism once the draft ran);
  ``SGLANG_SPEC_INJECT_FAULT_RANK=r``: on attention-TP rank r only (the others then fall back with it).
* ``SGLANG_SPEC_INJECT_ACCEPT_FAULT=n``: every n-th verify step raises at one stage of the plugin's accept, the
  stages the server runs taken in turn (``AcceptFaults``).
"""

from __future__ import annotations

from dataclasses import dataclass

# the plugin's accept, stage by stage (the ``stage`` label of sglang_spec_accept_faults_total)
ACCEPT = "accept"  # the fused accept's verify + accept kernels (--speculative-tree-accept fused)
COMMIT = "commit"  # the fused accept's KV commit
RECORD = "record"  # after the accept: the accepted paths handed to the context drafter, the rank counts
OBSERVE = "observe"  # at the next draft: the context drafter learns from the paths (lookup / hybrid)
COUNTS = "counts"  # per request, after the step: the per-position acceptance counts
AUTO = "auto"  # --speculative-tree-auto: the step's choice and its timing


class InjectedFault(RuntimeError):
    """A fault raised on purpose (``SGLANG_SPEC_INJECT_*_FAULT``), for the fault-injection tests."""


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
