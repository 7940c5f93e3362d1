"""The ``sglang-spec`` command line. Each subcommand lives in its own module; this one wires them together.

Errors in user input are printed as one line (``error: ...``) with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any, Sequence

from sglang_spec.cli import adapt as adapt_command
from sglang_spec.cli import calibrate as calibrate_command
from sglang_spec.cli import capture as capture_command
from sglang_spec.cli import generate as generate_command
from sglang_spec.cli import traffic as traffic_command
from sglang_spec.cli import train as train_command
from sglang_spec.cli import tree as tree_command
from sglang_spec.cli.parser import OneLineErrorParser
from sglang_spec.errors import exit_status


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="sglang-spec",
        description="Tree-based speculative decoding for SGLang: build, inspect and measure token trees.",
    )
    subcommands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    tree_command.add_parser(subcommands)
    generate_command.add_parser(subcommands)
    traffic_command.add_parser(subcommands)
    train_command.add_parser(subcommands)
    calibrate_command.add_parser(subcommands)
    capture_command.add_parser(subcommands)
    adapt_command.add_parser(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns the exit status (2 for bad input, with one ``error: ...`` line on stderr)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:  # a usage error (already printed in one line) or --help
        return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 2)
    # SIGTERM (a scheduler, `kill`) unwinds like Ctrl-C, so writers remove their temporary files
    previous = _on_sigterm(_terminate)
    try:
        return exit_status(lambda: int(args.run(args) or 0))
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except _Terminated:
        sys.stderr.write("terminated\n")
        return 143
    finally:
        _on_sigterm(previous)


class _Terminated(BaseException):
    """Raised in the main thread by SIGTERM (a BaseException, like KeyboardInterrupt, so cleanup code runs and
    ``except Exception`` does not swallow it)."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated()


def _on_sigterm(handler: Any) -> Any:
    """Installs ``handler`` for SIGTERM and returns the previous one (nothing outside the main thread)."""
    if threading.current_thread() is not threading.main_thread() or handler is None:
        return None
    return signal.signal(signal.SIGTERM, handler)


if __name__ == "__main__":
    raise SystemExit(main())
