"""A backend inside the user's own process (`LocalBackend(in_process=True)`) leaves that process as it
found it: no `mallopt` call changes glibc's malloc (seen through an LD_PRELOAD shim that notes every
call) and torch keeps its CPU allocator, through served requests and a training step. Each check is
shown to see what it looks for: the same process then makes the change itself (what the backend does
in a process it owns) and the check flips. `LocalBackend()` runs the backend in a process of its own,
which it does tune."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import checkout_env

# every mallopt call the process makes, noted on stderr, then passed on to glibc's own
SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
int mallopt(int param, int value) {
  static int (*real)(int, int);
  if (!real) real = (int (*)(int, int))dlsym(RTLD_NEXT, "mallopt");
  fprintf(stderr, "mallopt(%d, %d)\n", param, value);
  return real(param, value);
}
"""

SCRIPT = r"""
import asyncio, sys
import torch
from art_backend.engine.cpu_kernels import load_cpu_kernels
from art_backend.engine.host_memory import REUSE_KEPT_BYTES, return_freed_memory_to_os
from art_integrations import LocalBackend, TrainableModel, TrainConfig
from tests.conftest import scored_group


async def main() -> None:
    async with LocalBackend(in_process=True, model="tiny-random-smollm2", art_dir=sys.argv[1]) as backend:
        model = TrainableModel(name="agent", project="untouched")
        await model.register(backend)
        groups = [await scored_group(model, "a", [0.0, 1.0])]
        assert (await model.train(groups, TrainConfig(learning_rate=1e-3))).step == 1
    kernels = load_cpu_kernels()
    print("kernels:", kernels is not None, file=sys.stderr)
    print("allocator swapped:", kernels is not None and kernels.step_memory_installed(), file=sys.stderr)
    print("--- what the backend does in its own process", file=sys.stderr, flush=True)
    return_freed_memory_to_os()
    if kernels is not None:
        kernels.reuse_step_memory(True, REUSE_KEPT_BYTES)
        kernels.reuse_step_memory(False, 0)
        print("allocator swapped:", kernels.step_memory_installed(), file=sys.stderr)


asyncio.run(main())
"""


def test_a_backend_in_the_users_process_leaves_its_malloc_and_allocator_alone(tmp_path: Path) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not sys.platform.startswith("linux"):
        pytest.skip("needs a C compiler and glibc, for the shim that notes mallopt calls")
    shim = tmp_path / "mallopt_shim.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-x", "c", "-", "-o", str(shim), "-ldl"], input=SHIM, text=True,
                   check=True)
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "art")], capture_output=True, text=True,
                         env=checkout_env(LD_PRELOAD=str(shim)), timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    before, _, after = run.stderr.partition("--- what the backend does in its own process")
    assert after, run.stderr[-3000:]
    assert "mallopt(" not in before and "allocator swapped: False" in before
    assert "mallopt(-3, 131072)" in after  # M_MMAP_THRESHOLD fixed at 128 KiB
    if "kernels: True" in before:
        assert "allocator swapped: True" in after
