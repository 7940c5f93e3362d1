"""The argument parser every subcommand uses, and the checked number types its options take.

A number option is parsed by one of the types below, so a value out of range fails while the arguments are read,
in one line (``error: argument --lr: ...``, exit status 2), before any model loads.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable, NoReturn, Sequence, TypeVar

from sglang_spec.errors import brief
from sglang_spec.sampling import TEMPERATURE_FLOOR

# documented maxima (see each option's --help): beyond them a run is a typo, or hours of work by accident
MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 100.0
MAX_BATCH_SIZE = 4096
MAX_SAMPLES = 1000
MAX_STEPS = 10_000_000
MAX_SAMPLING_TOP_K = 2**31 - 1  # any top-k past the vocabulary is off; this only keeps it an int32

Item = TypeVar("Item")


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the problem and where to look."""

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())  # argparse may quote a multi-line value
        sys.stderr.write(f"error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(2)


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (no upper bound when ``high`` is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{brief(text)} is not an integer") from None
        if value < low or (high is not None and value > high):
            bound = f"[{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{brief(value)} is out of range; give an integer {bound}")
        return value

    parse.__name__ = "integer"
    return parse


def number(low: float, high: float, low_open: bool = False, high_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite float in the interval from ``low`` to ``high`` (each end closed unless open)."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{brief(text)} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{brief(text)} is not a finite number; give one in {interval}")
        below = value <= low if low_open else value < low
        above = value >= high if high_open else value > high
        if below or above:
            raise argparse.ArgumentTypeError(f"{value:g} is out of range; give a number in {interval}")
        return value

    parse.__name__ = "number"
    return parse


def one_of(names: Sequence[str], noun: str) -> Callable[[str], str]:
    """An argparse type: one of ``names`` (surrounding spaces ignored); anything else is "unknown ``noun``"."""

    def parse(text: str) -> str:
        if text.strip() not in names:
            raise argparse.ArgumentTypeError(f"unknown {noun} {text.strip()!r}; choose among {', '.join(names)}")
        return text.strip()

    parse.__name__ = noun
    return parse


def comma_list(item: Callable[[str], Item]) -> Callable[[str], list[Item]]:
    """An argparse type: one or more comma-separated values, each parsed (and range-checked) by ``item``."""

    def parse(text: str) -> list[Item]:
        parts = text.split(",")
        if any(not part.strip() for part in parts):
            raise argparse.ArgumentTypeError(f"{brief(text)}: give one or more values separated by commas")
        return [item(part) for part in parts]

    parse.__name__ = "list"
    return parse


def temperature(text: str) -> float:
    """An argparse type: a sampling temperature in [0, MAX_TEMPERATURE]; below TEMPERATURE_FLOOR it is greedy (0)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_TEMPERATURE:  # NaN too
        raise argparse.ArgumentTypeError(
            f"temperature must be >= 0 and <= {MAX_TEMPERATURE:g} (0 = greedy), got {brief(text.strip())}")
    return 0.0 if value < TEMPERATURE_FLOOR else value


def text_arg(text: str) -> str:
    """An argparse type: text that is valid UTF-8 (the shell passes other bytes as unpaired surrogates, which no
    tokenizer, JSON file or terminal takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"{ascii(brief(text))} is not valid UTF-8; pass UTF-8 text") from None
    return text


def path_arg(text: str) -> Path:
    """An argparse type: a path whose name is UTF-8 (it is printed and stored in JSON metadata)."""
    return Path(text_arg(text))


TEMPERATURE_HELP = (f"sampling temperature in [0, {MAX_TEMPERATURE:g}]; 0 = greedy, and any temperature below "
                    f"{TEMPERATURE_FLOOR:g} is greedy too")
seed = integer(0, MAX_SEED)
