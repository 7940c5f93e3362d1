"""Where converted models and other derived files are cached (never written at import time)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    """``$SGLANG_SPEC_CACHE`` if set, else ``~/.cache/sglang_spec``."""
    return Path(os.environ.get("SGLANG_SPEC_CACHE") or Path.home() / ".cache" / "sglang_spec")


@contextmanager
def build_lock(target: Path) -> Iterator[None]:
    """Holds an exclusive lock on building ``target`` (the file ``.<name>.lock`` beside it) for the ``with`` block.

    Contract: callers check for a complete ``target`` after taking the lock, so that of several processes asking
    for the same entry at once (parallel test workers, a server and a CLI) one builds it and the others wait and
    then read it; a build never deletes a folder another process is reading. The lock is released when the block
    ends or the process dies."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
