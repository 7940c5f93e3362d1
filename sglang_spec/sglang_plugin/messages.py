"""What the plugin tells an operator: one ``[sglang_spec]`` line on the server's stderr, or one ``error:`` line that
ends a launch."""

from __future__ import annotations

import sys

from sglang_spec.errors import SpecError


class StartupError(SystemExit):
    """Ends a launch with one ``error: ...`` line (SystemExit: launch_server prints it without a traceback)."""

    def __init__(self, error: SpecError | str) -> None:
        super().__init__(f"error: {error}")


def log(message: str) -> None:
    sys.stderr.write(f"[sglang_spec] {message}\n")
