"""Usage errors of the torch commands (``generate``, ``bench generate``, ``serve``): the values of the
command line checked before torch is imported (integers, numbers, sizes, dtypes, speculation modes),
and how a refusal or a failed run is reported (``_reporting``: one line on stderr and the exit code).

Numbers are written in ASCII digits (``1_0`` and ``٣`` are refused; a NaN fails the range check).
"""

from __future__ import annotations

import re
import sys
from typing import Callable, Optional

EXIT_USAGE = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
_INTEGER = re.compile(r"[+-]?[0-9]{1,30}")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"auto": None, "bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32",
                 "fp32": "float32"}  # vLLM's names (auto: the checkpoint's)
SPECS = ("none", "mtp", "dflash", "ngram")  # runtime/generate.py's SPECS, known here before torch is imported
MAX_SEQUENCES = 4096  # the most sequences one engine holds (--batch, --max-num-seqs): slots are tables


class UsageError(Exception):
    """A one-line complaint about the command line."""


def _int(value: str, name: str, low: int, high: Optional[int] = None) -> int:
    if not isinstance(value, str) or not _INTEGER.fullmatch(value.strip()):
        raise UsageError(f"{name} {value}: not an integer")
    n = int(value)
    if n < low or (high is not None and n > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise UsageError(f"{name} {value}: must be {bound}")
    return n


def _float(value: str, name: str) -> float:
    if not isinstance(value, str) or not (_DECIMAL.fullmatch(value.strip())
                                          or value.strip().lower() in ("nan", "inf", "-inf", "+inf")):
        raise UsageError(f"{name} {value}: not a number")
    return float(value)  # a NaN or an infinity is refused by the option's range check


_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?)B?", re.IGNORECASE)


def parse_size(text: str, name: str) -> int:
    """Bytes of a size such as 4GiB, 512MiB, 2G, 1.5GB or 1048576 (K/M/G/T: powers of 1024 with or
    without i, as vLLM reads them); UsageError naming the flag otherwise."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise UsageError(f"{name} {text}: not a size (give bytes or a number with KiB, MiB, GiB or TiB)")
    number, unit = float(match.group(1)), match.group(2).upper()
    size = int(number * 1024 ** "KMGT".find(unit) * 1024) if unit else int(number)
    if size < 1:
        raise UsageError(f"{name} {text}: must be positive")
    return size


def normalize_dtype(dtype: Optional[str]) -> Optional[str]:
    """``--dtype`` in torch's spelling (vLLM's names accepted; auto: None, the checkpoint's)."""
    if dtype is None or dtype in DTYPES:
        return dtype
    if dtype not in DTYPE_ALIASES:
        raise UsageError(f"--dtype {dtype}: unknown dtype (choose auto, {', '.join(DTYPES)}, bf16, half or float)")
    return DTYPE_ALIASES[dtype]


def _reporting(command: str, run: Callable[[], int]) -> int:
    """Run a command; a usage error or a failed run is one line on stderr and its exit code. (The
    interpreter, and with it the scheduler, is imported only once a run has failed: a RunError can
    only come from a run that imported it, and a usage error needs neither.)"""
    try:
        return run()
    except UsageError as err:
        print(f"fxsched {command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as err:
        from fxsched.runtime.interpreter import RunError

        if not isinstance(err, RunError):
            raise
        print(f"fxsched {command}: {err}", file=sys.stderr)
        return EXIT_FAILED
