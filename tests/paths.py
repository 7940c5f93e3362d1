"""Paths the tests share. A plain module, not a conftest: `from conftest import ...` resolves to whichever
conftest.py pytest imported last (tests/ and tests/sglang_server/ both have one)."""

from __future__ import annotations

from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
DATA_DIR = TESTS_DIR / "data"
BENCH_DIR = TESTS_DIR.parent / "bench"


def bench_module(name: str):
    """bench/<name>.py loaded as the module ``bench_<name>`` (the bench scripts' own tests only: the rest of the
    suite imports nothing of bench/), without putting bench/ on sys.path for every other test."""
    import importlib.util
    import sys

    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCH_DIR / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
    return sys.modules[key]
