"""The one exception type for bad user input.

A ``SpecError`` message is a single line that says what is wrong and how to fix it. The CLI prints it as
``error: <message>`` and exits with status 2; library callers can catch it as a ``ValueError``.
"""

from __future__ import annotations

import sys
from typing import Callable


class SpecError(ValueError):
    """Bad input (a tree, a profile, an option, a file). The message is one line, meant for a user."""

    def __init__(self, message: str) -> None:
        if "\n" in message:
            raise AssertionError(f"SpecError messages must be one line, got {message!r}")
        super().__init__(message)


def brief(value: object, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters, for quoting user input inside a one-line message."""
    try:
        text = repr(value)
    except ValueError:  # an integer too long to print
        text = f"<{type(value).__name__} too long to print>"
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def exit_status(main: Callable[[], int]) -> int:
    """Runs a script's ``main``: bad input (a SpecError) becomes one ``error: ...`` line on stderr and status 2."""
    try:
        return main()
    except SpecError as error:
        sys.stderr.write(f"error: {error}\n")
        return 2
