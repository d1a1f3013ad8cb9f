"""Builds and loads the fused CPU decode kernels of `cpu_kernels.cpp`, once per machine.

Hand-written because no maintained library ships these fusions for current CPU torch (Intel's
extension for PyTorch, which had similar ones, stopped at torch 2.8). torch's own extension
builder compiles them (~20 s, with the system's C++ compiler and the `ninja` package) into
TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions); later starts load the cached build
in well under a second.

torch's builder locks a build with a `lock` file that it waits on forever, and a process killed
while holding it (a SIGKILL during the build or its check) leaves it behind: every later start
would hang without a word. So each load first takes an OS lock of its own (released whenever its
holder dies); holding it, a `lock` file left in the build directory is known to be stale and is
removed, with a warning.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

# The translation units torch compiles. cpu_kernels.cpp includes the kernels themselves from kernels/*.h
# (by relative path): torch's ninja build records each object's headers (gcc's depfile), so editing
# one rebuilds at the next start, as editing a source does.
_SOURCES = [Path(__file__).with_name("cpu_kernels.cpp"), Path(__file__).with_name("step_memory.cpp")]

# The vector instructions torch itself uses on this CPU, as compiler flags: the kernels' loops and
# exps run 8-16 floats at a time instead of 4 (the sampler and SiLU ~3x faster than with SSE2).
# The build's name carries the choice, so machines with other CPUs never share a cached build.
_VECTOR_FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
                 "AVX2": ["-mavx2", "-mfma", "-mf16c"]}


def build_directory(name: str) -> Path:
    """Where torch builds the extension `name`: torch's own default for a CPU build of torch
    (TORCH_EXTENSIONS_DIR, else its cache folder per Python version), named here and handed to it,
    so the stale-lock check and the build look at one folder."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        root = os.path.join(get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_cpu")
    return Path(root) / name


def vector_build() -> bool:
    """Whether the kernels build with this CPU's vector instructions (AVX-512 or AVX2), which the
    exact-groups matmul needs to beat oneDNN's float32."""
    return torch.backends.cpu.get_cpu_capability() in _VECTOR_FLAGS


def compiler() -> str:
    """The C++ compiler torch's extension builder runs: $CXX, else `c++`."""
    return os.environ.get("CXX", "c++")


def openmp_refused(command: str) -> str | None:
    """Why `command` cannot build OpenMP code, or None. The kernels need OpenMP: torch's
    `at::parallel_for`, which spreads them over the cores, runs on one thread in code built without
    it. Apple's clang refuses `-fopenmp`."""
    source = "#include <omp.h>\nint main() { return omp_get_max_threads(); }\n"
    try:
        probe = subprocess.run([command, "-fopenmp", "-x", "c++", "-fsyntax-only", "-"], input=source,
                               capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{command} could not be run ({error!r})"
    if probe.returncode != 0:
        return f"{command} has no OpenMP ({first_error_line(probe.stderr)}), which the kernels' threads need"
    return None


def first_error_line(output: str) -> str:
    """The compiler's first error in `output` (a build log), else its first non-empty line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\berror:", line, re.IGNORECASE)]  # gcc's and clang's form
    return (errors or lines or ["(no output)"])[0]


def cannot_build() -> str | None:
    """Why the kernels cannot be built here, or None: a compiler and ninja are what they need."""
    if shutil.which(compiler()) is None:
        return (f"no C++ compiler: {compiler()!r} is not on PATH. Install one with OpenMP (g++, or clang++ with "
                "libomp), or point $CXX at it")
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "the `ninja` build tool is missing: `pip install ninja` in this environment"
    return None


@functools.cache
def load_cpu_kernels() -> Any | None:
    """`torch.ops.art_cpu_kernels`, or None, with a warning saying why, where they cannot be built."""
    from torch.utils.cpp_extension import load  # imports setuptools: only when serving on CPU

    fallback = ("so decoding uses plain torch ops and float32 weights (~2x slower for the embedded model). "
                "ART_BACKEND_CPU_KERNELS=false skips the attempt")
    reason = cannot_build() or openmp_refused(compiler())
    if reason is not None:
        logger.warning("The fused CPU decode kernels cannot be built here, %s: %s.", fallback, reason)
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    # -fno-split-loops: GCC splits a row's loop over keys at its shared length (`HeadKV`) and
    # vectorizes the two halves differently, so on AVX2 reading a shared prompt start from another
    # slot gave other last bits than reading the row's own copy of the same numbers
    flags = ["-O3", "-fopenmp", "-fno-trapping-math", "-fno-split-loops", *_VECTOR_FLAGS.get(capability, [])]
    name = f"art_cpu_kernels_{capability.lower()}"
    started = time.perf_counter()
    try:
        build = build_directory(name)
        build.mkdir(parents=True, exist_ok=True)
        with open(build.parent / f"{name}.art-lock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            stale = build / "lock"
            if stale.exists():
                logger.warning("Removing %s: a build of the CPU kernels was killed while holding it, and torch "
                               "would wait for it forever", stale)
                stale.unlink()
            load(name=name, sources=[str(source) for source in _SOURCES], extra_cflags=flags, is_python_module=False,
                 build_directory=str(build))
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as error:
        logger.warning("The fused CPU decode kernels did not build with %s, %s. The compiler said: %s (the whole "
                       "build log goes to this logger at DEBUG)", compiler(), fallback, first_error_line(str(error)))
        logger.debug("The CPU kernels' build failed:\n%s", error)
        return None
    logger.info("Fused CPU decode kernels (%s) ready in %.1f s", capability, time.perf_counter() - started)
    return torch.ops.art_cpu_kernels
