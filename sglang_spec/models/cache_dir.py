"""Where converted models and other derived files are cached (never written at import time)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$SGLANG_SPEC_CACHE`` if set, else ``~/.cache/sglang_spec``."""
    return Path(os.environ.get("SGLANG_SPEC_CACHE") or Path.home() / ".cache" / "sglang_spec")
