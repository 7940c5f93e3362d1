"""The CPU test bed's thread counts: every SGLang process's (``SGLANG_SPEC_CPU_THREADS``, default 1) and its
prefills' (``SGLANG_SPEC_CPU_PREFILL_THREADS=N``, opt-in: more threads than decode steps).

The bed runs every SGLang process on one OpenMP thread (``server_environment``): a decode step on two threads stalls
at its barriers whenever another process is busy on the other core, and the test suite always has one. A prefill
is a different kind of work: hundreds of rows through ``F.linear`` (MKL), compute-bound, about 1.7 s for a
520-token SmolLM2 prompt on one core here, 35 decode steps' worth, where a GPU spends one or two. That share is
the same for every server, so it dilutes every speedup the bed measures at one request. On a machine of its own
(the serving sweep's ``--prefill-threads``, nothing else running) a prefill on both cores takes ~1.1 s instead of
~2.0 s (transformers' SmolLM2 forward at 520 tokens, 1 / 2 threads, ad-hoc timing).

Registered as a HookRegistry hook by ``sglang_spec.sglang_plugin.register`` when the harness is active and the
variable is set: ``ModelRunner.forward`` of an EXTEND / MIXED / SPLIT_PREFILL batch of ``PREFILL_MIN_TOKENS`` or
more input tokens (a prefill, or the draft's pass over a prompt; never a tree verify or a decode step) runs with
``N`` intra-op threads, and the previous count is restored after it. Only the thread count changes, so results are
the same up to float32 summation order inside MKL's GEMMs.
"""

from __future__ import annotations

import os

import torch

from sglang_spec.errors import SpecError
from sglang_spec.sglang_plugin.messages import log

PREFILL_THREADS_ENV = "SGLANG_SPEC_CPU_PREFILL_THREADS"
# every SGLang process's OpenMP threads (``server_environment``): one unless a machine of its own asks for more
THREADS_ENV = "SGLANG_SPEC_CPU_THREADS"

# a batch of this many input tokens or more counts as a prefill (a tree verify is at most 64 nodes a request, and
# the modes below exclude it anyway; a short prompt stays on one thread, where a second buys nothing)
PREFILL_MIN_TOKENS = 128

PREFILL_MODES = ("EXTEND", "MIXED", "SPLIT_PREFILL")

HOOKS = (("sglang.srt.model_executor.model_runner.ModelRunner.forward", "model_forward_around", "AROUND"),)


def _thread_count(name: str, environment) -> int | None:
    """The positive integer the variable ``name`` holds (None when unset or empty); anything else is one line
    (``SpecError``)."""
    value = (os.environ if environment is None else environment).get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise SpecError(f"{name}={value!r} is not a thread count; give a positive integer (2 on a 2-core machine of "
                        f"its own) or unset it")
    return int(value)


def prefill_threads_from_environment(environment=None) -> int | None:
    """The thread count ``SGLANG_SPEC_CPU_PREFILL_THREADS`` names (None when unset or empty). A value that is not a
    positive integer is one line (``SpecError``); ``activate`` checks it before SGLang starts."""
    return _thread_count(PREFILL_THREADS_ENV, environment)


def threads_from_environment(environment=None) -> int:
    """Every SGLang process's OpenMP threads: what ``SGLANG_SPEC_CPU_THREADS`` names, 1 when unset or empty (one
    thread a process: on a 2-core machine a second busy process stalls a multi-threaded op at its barriers). A
    value that is not a positive integer is one line (``SpecError``), raised by ``server_environment`` before a
    server starts."""
    return _thread_count(THREADS_ENV, environment) or 1


class PrefillThreads:
    """The hook, bound to its thread count at registration (no environment read per forward)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.said: set[str] = set()  # the roles (target, draft) whose first prefill here was logged

    def model_forward_around(self, original, runner, forward_batch, *args, **kwargs):
        if forward_batch.forward_mode.name not in PREFILL_MODES or \
                forward_batch.input_ids.numel() < PREFILL_MIN_TOKENS:
            return original(runner, forward_batch, *args, **kwargs)
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return original(runner, forward_batch, *args, **kwargs)
        finally:
            ran_on = torch.get_num_threads()
            torch.set_num_threads(previous)
            role = "draft" if getattr(runner, "is_draft_worker", False) else "target"
            if role not in self.said:
                self.said.add(role)
                log(f"CPU bed: the {role} model's prefills of {PREFILL_MIN_TOKENS}+ tokens run on {ran_on} threads "
                    f"(decode steps on {previous}; first: {forward_batch.input_ids.numel()} tokens)")


def hooks(threads: int | None):
    """(target, hook, kind) for HookRegistry: none when ``threads`` is None."""
    if threads is None:
        return ()
    prefill = PrefillThreads(threads)
    return tuple((target, getattr(prefill, name), kind) for target, name, kind in HOOKS)
