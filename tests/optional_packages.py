"""Optional packages a test module needs: skip where they are absent, fail where CI promised them."""

from __future__ import annotations

import os

import pytest


def require_sglang() -> None:
    """sglang must be importable where the set-up script ran (CI sets SGLANG_SPEC_REQUIRE_SGLANG=1); elsewhere
    the tests that need it skip."""
    try:
        import sglang  # noqa: F401
    except ImportError:
        if os.environ.get("SGLANG_SPEC_REQUIRE_SGLANG") == "1":
            raise
        pytest.skip("sglang is not installed")
