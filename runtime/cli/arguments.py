"""The command line's argument parsing, shared by every ``fxsched`` verb: a parser whose refusals
are one line and exit 2 (``EXIT_USAGE``), and the strict value types (integers in ASCII digits,
seconds, batch sizes) its options use. The verbs' modules import it; it imports none of them.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import NoReturn

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
MAX_SEED = 2**63 - 1
_INTEGER = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse`` parser whose refusals are one line (``fxsched check: argument --steps:
    ...``) and exit 2; its sub-command parsers are of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {' '.join(message.split())}\n")


def strict_int(text: str) -> int:
    """An integer written in ASCII digits (an optional sign; no ``1_0``, no other scripts' digits)."""
    if not _INTEGER.fullmatch(text) or len(text) > 40:
        raise ValueError(f"{text!r} is not an integer")
    return int(text)


def int_arg(low: int, high: int):
    """An argparse ``type``: a strict integer from ``low`` to ``high``."""

    def parse(text: str) -> int:
        try:
            value = strict_int(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text}: must be from {low} to {high}")
        return value

    return parse


MAX_SECONDS = 7 * 86_400.0  # a week


def seconds_arg(text: str) -> float:
    """An argparse ``type``: a number of seconds above 0, at most ``MAX_SECONDS``."""
    value = float(text) if _DECIMAL.fullmatch(text) else math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds above 0, at most {MAX_SECONDS:g}")
    return value


def sizes_arg(text: str) -> tuple[int, ...]:
    """An argparse ``type``: comma-separated batch sizes from 1 to 4096."""
    parse = int_arg(1, 4096)
    words = [w.strip() for w in text.split(",")]
    if not text.strip() or any(not w for w in words):
        raise argparse.ArgumentTypeError(f"{text!r}: expected sizes separated by commas, e.g. 1,8,64")
    return tuple(parse(w) for w in words)
