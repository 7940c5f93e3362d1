"""Cached models are built once however many processes ask at the same time (parallel test workers, a server and
a CLI): the builder takes the entry's lock, and whoever waited finds it complete instead of rebuilding over it."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from sglang_spec.models.cache_dir import build_lock


def _build_once(target: str, started, results) -> None:
    entry = Path(target)
    with build_lock(entry):
        started.set()
        if (entry / ".complete").exists():
            results.put("found")
            return
        entry.mkdir()
        (entry / ".complete").write_text("built\n")
        results.put("built")


def test_a_second_builder_waits_for_the_first_and_finds_the_entry_complete(tmp_path):
    context = multiprocessing.get_context("fork")
    entry = tmp_path / "model"
    started, results = context.Event(), context.Queue()
    with build_lock(entry):  # this process holds the lock: both children must wait for it
        children = [context.Process(target=_build_once, args=(str(entry), started, results)) for _ in range(2)]
        for child in children:
            child.start()
        assert not started.wait(0.5)  # neither child got in while the lock was held (a no-op lock fails here)
    for child in children:
        child.join(30)
    assert sorted(results.get(timeout=5) for _ in children) == ["built", "found"]
