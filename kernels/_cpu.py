"""Shared loader of the CPU kernels: C files compiled on first use, loaded through ctypes.

A CPU kernel here is a plain C file beside its Python module (no torch headers, so it compiles in
about a second). `load(name, symbols)` compiles `<name>.c` with the system C compiler into the
user's cache directory (``$XDG_CACHE_HOME/fxsched`` or ``~/.cache/fxsched``; the file name carries a
hash of the source and flags, so an edited kernel recompiles, and concurrent processes each compile
then atomically rename, so none reads a half-written file) and loads it with ctypes, whose calls
release the GIL. It returns None -- and the caller keeps its torch reference -- with
``FXSCHED_KERNELS=torch``, on a CPU below the kernel's instruction sets, without a compiler, or when
compiling or loading fails (logged once, as ``cpu_kernel_unavailable``).

Two instruction-set levels (cpu-kernels.md §15.6): ``avx512`` (AVX512F/BW/VL and AVX512-BF16:
Sapphire Rapids, Zen 4 and later) and ``avx2`` (AVX2 and FMA: nearly every x86 server since 2015).
A kernel's C file builds for both from one source, choosing its code with ``#ifdef __AVX512BF16__``;
a kernel that only makes sense on the first (AMX) says so. ``FXSCHED_CPU_ISA=avx2`` builds the
lower level on a host that has the higher one (to compare them, or to test the AVX2 code there).
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

__all__ = ["bf16_arithmetic", "host_isa", "load", "split", "torch_only"]

log = structlog.get_logger("fxsched.kernels")

FLAGS = {
    "avx512": ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-shared", "-fPIC"),
    "avx2": ("-O3", "-mavx2", "-mfma", "-mf16c", "-shared", "-fPIC"),
}
ISAS = tuple(FLAGS)  # highest first


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def _asked() -> str:
    return os.environ.get("FXSCHED_CPU_ISA", "").strip().lower()


def host_isa() -> str | None:
    """The highest build level this CPU runs ("avx512" or "avx2"), lowered by ``FXSCHED_CPU_ISA``;
    None below AVX2 + FMA (or where /proc/cpuinfo cannot be read)."""
    flags = _cpu_flags()
    have = [isa for isa, need in (("avx512", {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma"}),
                                  ("avx2", {"avx2", "fma", "f16c"})) if need <= flags]
    asked = _asked()
    if asked in ISAS:
        have = [isa for isa in have if ISAS.index(isa) >= ISAS.index(asked)]
    return have[0] if have else None


def amx_allowed() -> bool:
    """Whether the kernels may use AMX tiles: the CPU names AMX tiles and AMX-BF16, the AVX512 build
    is in use, and ``FXSCHED_CPU_ISA`` does not lower the level below ``amx`` (``avx512`` runs an
    AMX host as an AVX512-BF16 one, so that path is tested and measured there too)."""
    return {"amx_tile", "amx_bf16"} <= _cpu_flags() and host_isa() == "avx512" and _asked() not in ISAS


def torch_only() -> bool:
    """Whether ``FXSCHED_KERNELS=torch`` asks for PyTorch's own paths everywhere (no kernel here)."""
    return os.environ.get("FXSCHED_KERNELS", "").strip().lower() == "torch"


def bf16_arithmetic() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16). Without it PyTorch's
    bf16 matrix products run a generic path at about a tenth of its fp32 speed, so the linears
    widen to fp32 instead (kernels/cpu_widen.py)."""
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "fxsched"


def _compile(name: str, source: Path, flags: tuple[str, ...]) -> Path | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("cpu_kernel_unavailable", kernel=name, reason="no C compiler (cc, gcc or $CC)")
        return None
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what it may include
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


def load(name: str, symbols: dict[str, list[Any]], extra_flags: tuple[str, ...] = (),
         isas: tuple[str, ...] = ISAS) -> ctypes.CDLL | None:
    """The compiled `kernels/<name>.c` with each symbol's argtypes set (restype int), or None.
    extra_flags: compiler flags this kernel alone needs (an instruction set beyond FLAGS');
    isas: the levels its source builds for (it is compiled for the host's level)."""
    isa = host_isa()
    if torch_only() or isa not in isas:
        return None
    path = _compile(f"{name}-{isa}", Path(__file__).with_name(f"{name}.c"), (*FLAGS[isa], *extra_flags))
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
