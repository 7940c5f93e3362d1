"""Helpers for the tests that run SGLang's real server on this CPU (fixtures are in conftest.py)."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import pytest

from sglang_spec_testbed.parity import (REPEAT_CONTEXT_PROMPTS, REPEAT_NEW_TOKENS, accept_lengths,  # noqa: F401
                                        tree_args)
from sglang_spec_testbed.server import CpuModel, PortTaken, SGLangServer, cpu_launch_args, free_port

START_TIMEOUT = float(os.environ.get("SGLANG_SPEC_SERVER_TIMEOUT", "240"))
SMOLLM2_NEW_TOKENS = 40  # greedy tokens per held-out prompt in the SmolLM2 end-to-end tests
TINY_NEW_TOKENS = 32  # greedy tokens per toy-language prompt in the tiny DeepSeek-V3 tests


@contextlib.contextmanager
def running_server(model: CpuModel, logs: Path, name: str, extra: Sequence[str] = (),
                   speculative: bool = True) -> Iterator[SGLangServer]:
    """A launch_server on this CPU for the duration of the block; asserts its log shows no traceback. A port
    taken between ``free_port`` and the server's bind (a race with other processes) gets one more try. Forked from
    a launcher that imported sglang once (``sglang_spec_testbed/zygote.py``): the same launch in half the time;
    stopped without waiting for SGLang's shutdown (up to 5 s before it starts), which goes on beside the next
    test."""
    for attempt in range(2):
        port = free_port()
        server = SGLangServer(cpu_launch_args(model, port, speculative=speculative, extra=extra), port,
                             logs / f"{name}.log", launcher="fork")
        try:
            server.start(timeout=START_TIMEOUT)
            break
        except PortTaken:
            if attempt:
                raise
    try:
        yield server
    finally:
        server.stop(wait=False)
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, f"{name}: the server logged a traceback:\n" + server.log_tail(60)


def faulty_run(model: CpuModel, logs: Path, name: str, extra: Sequence[str], prompts: list,
               faults: Mapping[str, str]) -> dict:
    """The fault-injection tests' run: a server started with ``faults`` (``SGLANG_SPEC_INJECT_*_FAULT``) in its
    environment; its greedy answers to ``prompts``, two sampled answers, its /metrics, a greedy answer sent after
    those metrics were read, and its log."""
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(pytest.MonkeyPatch.context())
        for variable, value in faults.items():
            patch.setenv(variable, value)
        server = stack.enter_context(running_server(model, logs, name, extra))
        greedy = server.generate(prompts, {"temperature": 0, "max_new_tokens": SMOLLM2_NEW_TOKENS})
        sampled = server.generate(prompts[:2], {"temperature": 0.8, "max_new_tokens": 8})
        metrics = server.request("/metrics")
        after = server.generate(prompts[:1], {"temperature": 0, "max_new_tokens": 4})
    return {"greedy": greedy, "sampled": sampled, "metrics": metrics, "after": after,
            "log": server.log_path.read_text(errors="replace")}


def counted_draft_faults(metrics: str, error: str) -> int | None:
    """``sglang_spec_draft_faults_total{error=...}`` in a /metrics page; None when the page has no such line."""
    found = re.search(rf'sglang_spec_draft_faults_total\{{error="{error}"\}} (\S+)', metrics)
    return None if found is None else int(float(found.group(1)))


def assert_draft_faults_counted_and_logged(run: dict, also: Sequence[str] = ()) -> None:
    """Each injected draft fault is counted (read before the last request, whose drafts may have raised too) and
    logged in one line; no traceback. ``also``: the other draft-fault errors injected on the server (their lines
    are left to their own checks)."""
    lines = [line for line in run["log"].splitlines() if "draft fault" in line]
    injected = [line for line in lines if "(InjectedFault" in line]
    counted = counted_draft_faults(run["metrics"], "InjectedFault")
    assert counted is not None, run["metrics"][-2000:]
    assert 0 < counted <= len(injected)
    assert all("verified without speculation (InjectedFault" in line for line in injected), injected[:3]
    assert all(any(f"({error}" in line for error in ("InjectedFault", *also)) for line in lines), lines[:3]
    assert "Traceback" not in run["log"]


def counter(metrics: str, name: str) -> float:
    """A counter's value on /metrics, summed over its labels (0 when absent)."""
    return sum(float(value) for value in re.findall(rf"^{name}(?:\{{[^}}]*\}})? ([\d.e+]+)$", metrics, re.M))


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def assert_full_masks_only(name: str, log: str, built: bool, read: bool) -> None:
    """A server run with ``SGLANG_SPEC_CPU_TREE_MASK=full`` (the GPU's FULL_MASK layout) logged a FULL_MASK tree mask
    built by SGLang's build-tree path (``built``) and read by the verify's extend attention (``read``), with the
    prefix's columns in it, and no QLEN_ONLY mask: a switch that did nothing fails. A chain (topk 1) is built but
    not read (SGLang's ``intel_amx`` backend passes no mask for ``tree_topk == 1``); NGRAM builds its mask itself."""
    built_line = re.search(r"\[sglang_spec\] CPU bed: first FULL_MASK tree mask built \((\d+) requests x (\d+) "
                           r"tokens\)", log)
    read_line = re.search(r"\[sglang_spec\] CPU bed: first FULL_MASK tree mask read \(extend attention: (\d+) "
                          r"requests x (\d+) tokens, (\d+) cells\)", log)
    qlen = re.findall(r"first QLEN_ONLY tree mask .*", log)
    assert not qlen, f"{name}: a QLEN_ONLY mask was built or read: {qlen}"
    assert (built_line is not None) == built, f"{name}: {built_line}"
    assert (read_line is not None) == read, f"{name}: {read_line}"
    if read_line is not None:
        requests, tokens, cells = map(int, read_line.groups())
        assert cells > requests * tokens * tokens  # the prefix's columns are in the mask
