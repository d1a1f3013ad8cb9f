"""Builds and loads the fused CPU decode kernels of `cpu_kernels.cpp`, once per machine.

Hand-written because no maintained library ships these fusions for current CPU torch (Intel's
extension for PyTorch, which had similar ones, stopped at torch 2.8). torch's own extension
builder compiles them (~15 s, with the system's C++ compiler and the `ninja` package) into
TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions); later starts load the cached build
in well under a second.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")


@functools.cache
def load_cpu_kernels() -> Any | None:
    """`torch.ops.art_cpu_kernels`, or None, with a warning saying why, where they cannot be built."""
    from torch.utils.cpp_extension import load  # imports setuptools: only when serving on CPU

    started = time.perf_counter()
    try:
        load(name="art_cpu_kernels", sources=[str(_SOURCE)], extra_cflags=["-O3", "-fopenmp", "-fno-trapping-math"],
             is_python_module=False)
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as error:
        logger.warning(
            "The fused CPU decode kernels could not be built, so decoding uses plain torch ops (~1.2x slower): %s. "
            "To build them, install a C++ compiler (g++) and the `ninja` package; to skip the attempt, set "
            "ART_BACKEND_CPU_KERNELS=false.", error)
        return None
    logger.info("Fused CPU decode kernels ready in %.1f s", time.perf_counter() - started)
    return torch.ops.art_cpu_kernels
