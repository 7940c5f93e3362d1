"""The ``sglang-spec`` command line. Each subcommand lives in its own module; this one wires them together.

Errors in user input are printed as one line (``error: ...``) with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from sglang_spec.cli import calibrate as calibrate_command
from sglang_spec.cli import calibrate_sources as calibrate_sources_command
from sglang_spec.cli import generate as generate_command
from sglang_spec.cli import traffic as traffic_command
from sglang_spec.cli import train as train_command
from sglang_spec.cli import tree as tree_command
from sglang_spec.cli.parser import OneLineErrorParser
from sglang_spec.errors import SpecError


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
    calibrate_sources_command.add_parser(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except SpecError as error:
        sys.stderr.write(f"error: {error}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
