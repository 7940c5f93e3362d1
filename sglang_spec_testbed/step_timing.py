"""Per-batch timings of SGLang's scheduler on the CPU test bed (``SGLANG_SPEC_CPU_PROFILE=<folder>``).

Registered as HookRegistry hooks by ``sglang_spec.sglang_plugin.register`` when the harness is active and the
variable is set. Every batch the scheduler runs adds one line to ``<folder>/steps.jsonl``: its forward mode
(``DECODE`` for a decode step: a tree step's draft, verify and draft extend, or a plain step's one forward;
``EXTEND`` for a prefill), batch size, ``start`` (``time.perf_counter`` when ``run_batch`` began), ``run_s`` (its
``run_batch``) and the time spent in ``ModelRunner.forward`` during it, split into the target's (``target_s``) and
the draft's (``draft_s``: draft decode steps and draft extend), the forward modes of the target's forwards
(``target_modes``: ``TARGET_VERIFY`` for a speculative server's tree or plain step, ``DECODE`` for plain decoding
and for tree auto's cold step), and for a decode step ``kv_ahead``: the most KV slots a request of the batch holds
past its committed tokens as the step starts (SGLang's decode reserve). With SGLang's overlap loop (plain servers;
speculative servers on a CPU run without it, by SGLang's rule, unless ``patches.OVERLAP_ENV`` keeps it) a batch's
result is processed after the next batch is launched, so a step's full cost is the loop's period: the next line's
``start`` minus this one's. With ``SGLANG_SPEC_CPU_PROFILE_CPROFILE=1`` those periods of decode steps run under
``cProfile`` (which slows them: time them without it) and ``<folder>/decode.pstats`` holds the cumulative
statistics. Both are written when the scheduler goes idle (the lines also every ``FLUSH_EVERY`` batches), so
nothing is lost when the server is killed after its last request.
"""

from __future__ import annotations

import cProfile
import json
import os
import time
from pathlib import Path

PROFILE_ENV = "SGLANG_SPEC_CPU_PROFILE"
CPROFILE_ENV = "SGLANG_SPEC_CPU_PROFILE_CPROFILE"

FLUSH_EVERY = 32  # batches held before they are written (also written whenever the scheduler goes idle)

HOOKS = (
    ("sglang.srt.managers.scheduler.Scheduler.run_batch", "run_batch_around", "AROUND"),
    ("sglang.srt.managers.scheduler.Scheduler.on_idle", "on_idle_after", "AFTER"),
    ("sglang.srt.model_executor.model_runner.ModelRunner.forward", "model_forward_around", "AROUND"),
)


class _Recorder:
    """The batch in ``run_batch`` (``current``: None outside it), the batches not yet written, and the profiler
    (on from the start of a decode step's ``run_batch`` to the start of the next batch or idleness)."""

    def __init__(self) -> None:
        self.current: dict | None = None
        self.pending: list[dict] = []
        self.profiler = cProfile.Profile() if os.environ.get(CPROFILE_ENV) == "1" else None
        self.profiling = False

    def profile(self, on: bool) -> None:
        if self.profiler is None or on == self.profiling:
            return
        if on:
            self.profiler.enable()
        else:
            self.profiler.disable()
        self.profiling = on


_recorder = _Recorder()


def run_batch_around(original, scheduler, batch, *args, **kwargs):
    record = {"mode": batch.forward_mode.name, "batch": int(batch.batch_size()), "start": time.perf_counter(),
              "run_s": 0.0, "target_s": 0.0, "draft_s": 0.0, "target_modes": []}
    if record["mode"] == "DECODE":
        record["kv_ahead"] = max((request.kv.kv_allocated_len - request.kv.kv_committed_len
                                  for request in batch.reqs), default=0)
    _recorder.profile(record["mode"] == "DECODE")
    _recorder.current = record
    try:
        return original(scheduler, batch, *args, **kwargs)
    finally:
        record["run_s"] = time.perf_counter() - record["start"]
        _recorder.current = None
        _recorder.pending.append(record)
        if len(_recorder.pending) >= FLUSH_EVERY:  # a server stopped while busy loses at most this many lines
            _flush()


def model_forward_around(original, runner, forward_batch, *args, **kwargs):
    record = _recorder.current
    if record is None:
        return original(runner, forward_batch, *args, **kwargs)
    if not runner.is_draft_worker:
        record["target_modes"].append(forward_batch.forward_mode.name)
    start = time.perf_counter()
    try:
        return original(runner, forward_batch, *args, **kwargs)
    finally:
        record["draft_s" if runner.is_draft_worker else "target_s"] += time.perf_counter() - start


def on_idle_after(result, scheduler) -> None:
    _recorder.profile(False)
    _flush()
    folder = Path(os.environ[PROFILE_ENV])
    if _recorder.profiler is not None and folder.is_dir():  # here only: a dump mid-run lands in a profiled period
        _recorder.profiler.dump_stats(folder / "decode.pstats")


def _flush() -> None:
    """Appends the pending batches to steps.jsonl."""
    if not _recorder.pending:
        return
    folder = Path(os.environ[PROFILE_ENV])
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "steps.jsonl").open("a") as out:
        for record in _recorder.pending:
            out.write(json.dumps(record) + "\n")
    _recorder.pending.clear()
