"""Shared loader of the CPU kernels: C files compiled on first use, loaded through ctypes.

A CPU kernel here is a plain C file beside its Python module (no torch headers, so it compiles in
about a second). `load(name, symbols)` compiles `<name>.c` with the system C compiler into the
user's cache directory (``$XDG_CACHE_HOME/fxsched`` or ``~/.cache/fxsched``; the file name carries a
hash of the source and flags, so an edited kernel recompiles, and concurrent processes each compile
then atomically rename, so none reads a half-written file) and loads it with ctypes, whose calls
release the GIL. It returns None -- and the caller keeps its torch reference -- with
``FXSCHED_KERNELS=torch``, on a CPU without AVX512-BF16, without a compiler, or when compiling or
loading fails (logged once, as ``cpu_kernel_unavailable``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import structlog

__all__ = ["load", "split"]

log = structlog.get_logger("fxsched.kernels")

FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-shared", "-fPIC")


@functools.cache
def cpu_supported() -> bool:
    """Whether this CPU has the instructions the kernels are compiled for (AVX512-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags and " avx512bw" in flags and " avx512vl" in flags


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "fxsched"


def _compile(name: str, source: Path, extra: tuple[str, ...] = ()) -> Path | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("cpu_kernel_unavailable", kernel=name, reason="no C compiler (cc, gcc or $CC)")
        return None
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what it may include
    flags = (*FLAGS, *extra)
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{digest}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as err:
        log.warning("cpu_kernel_unavailable", kernel=name, reason=f"cache directory: {err}")
        return None
    try:
        done = subprocess.run([compiler, *flags, str(source), "-o", tmp], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            log.warning("cpu_kernel_unavailable", kernel=name, reason="compile failed", stderr=done.stderr[-400:])
            return None
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("cpu_kernel_unavailable", kernel=name, reason=f"compile failed: {err}")
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(name: str, symbols: dict[str, list[Any]], extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled `kernels/<name>.c` with each symbol's argtypes set (restype int), or None.
    extra_flags: compiler flags this kernel alone needs (an instruction set beyond FLAGS')."""
    if os.environ.get("FXSCHED_KERNELS", "").strip().lower() == "torch" or not cpu_supported():
        return None
    path = _compile(name, Path(__file__).with_name(f"{name}.c"), extra_flags)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as err:
        log.warning("cpu_kernel_unavailable", kernel=name, reason=f"load failed: {err}")
        return None
    for symbol, argtypes in symbols.items():
        fn = getattr(lib, symbol)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    return lib


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fxsched-cpu")


def split(run: Callable[[int, int], int], n: int, threads: int, align: int = 1) -> int:
    """Runs run(lo, hi) over [0, n) in at most `threads` contiguous ranges (each a multiple of
    `align` long but the last) on a shared thread pool -- ctypes calls release the GIL, so the
    ranges run in parallel -- and returns the largest return code (0: all succeeded)."""
    if threads <= 1 or n <= align:
        return run(0, n)
    step = -(-n // threads // align) * align
    return max(_pool(threads).map(lambda lo: run(lo, min(n, lo + step)), range(0, n, step)))
