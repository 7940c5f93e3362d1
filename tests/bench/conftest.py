"""Fixtures for the bench scripts' tests: each script imported the way it runs (bench/ on the path, so its
`import harness` works)."""

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench_script(monkeypatch):
    """bench_script("hybrid") -> bench/hybrid.py as a module."""

    def load(name: str):
        monkeypatch.syspath_prepend(str(BENCH))
        return importlib.import_module(name)

    return load


@pytest.fixture
def acceptance(bench_script):
    return bench_script("acceptance")


@pytest.fixture
def hybrid_bench(bench_script):
    return bench_script("hybrid")
