"""Paths the tests share. A plain module, not a conftest: `from conftest import ...` resolves to whichever
conftest.py pytest imported last (tests/ and tests/sglang_server/ both have one)."""

from __future__ import annotations

from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
DATA_DIR = TESTS_DIR / "data"
