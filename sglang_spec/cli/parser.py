"""The argument parser every subcommand uses."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the problem and where to look."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(2)
