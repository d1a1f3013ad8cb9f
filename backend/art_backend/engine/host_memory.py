"""Freed host memory goes back to the operating system (glibc's allocator).

glibc serves an allocation below its mmap threshold from heap arenas, and after a large block is
freed it raises that threshold (up to 32 MiB). So after the first training step nearly every
activation, gradient and logits tensor lands in arenas that keep their pages once the tensor is
freed: one step of the main job on the embedded model peaked at 4.2 GB and the process stayed at
3.8 GB after it. A fixed threshold (setting it also stops the raising) puts each such tensor in
a mapping of its own, unmapped when freed: the same step peaked at 2.9 GB and the process went
back to 1.0 GB (`LoraTrainer.step` on tests/fixtures/city_facts_step.jsonl, the process's VmHWM and
VmRSS; `make bench-training` reports each step's peak and kept memory).

The price is a page fault for every fresh page of every such tensor, the kernel zero-filling it:
a third of a training step's time on the embedded model. `reusing_freed_memory` wins that back
for the length of a training step or a prefill (step_memory.cpp): blocks freed within it go to
the next request of their size, and at its end all kept blocks are freed.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's starting value, kept fixed
USER_SETTING = "MALLOC_MMAP_THRESHOLD_"  # glibc reads it at start; a user's own choice is left alone
# What `reusing_freed_memory` keeps at most, and so adds at most to a step's peak. The main job's
# stored step took 11.9 s keeping nothing, 8.7 s keeping 64 MiB and 7.9 s keeping 256 MiB (its
# peak 1.29 -> 1.34 -> 1.48 GB); a prefill needs about this much to gain at all.
REUSE_KEPT_BYTES = 256 << 20

_done = False
_refusal_told = False  # the warning that the reuse was refused, given once


def return_freed_memory_to_os() -> None:
    """Fix glibc's mmap threshold for this process (once; elsewhere than glibc, nothing)."""
    global _done
    if _done or not sys.platform.startswith("linux") or USER_SETTING in os.environ:
        return
    _done = True
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own: a preloaded allocator's, where one is
    except (OSError, AttributeError) as error:  # not glibc (musl has no mallopt to set)
        logger.info("Host memory: no glibc mallopt (%r); freed tensors may stay in the allocator's heap", error)
        return
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        logger.warning("Host memory: glibc refused M_MMAP_THRESHOLD=%d; the process may keep its peak memory "
                       "after each training step", MMAP_THRESHOLD_BYTES)


@contextlib.contextmanager
def reusing_freed_memory(cpu_kernels: Any | None) -> Iterator[None]:
    """Within: host memory torch frees is kept, up to REUSE_KEPT_BYTES, and handed out again to
    requests of its size (`cpu_kernels`: `load_cpu_kernels()`; None, where they could not be
    built: nothing changes). On leaving, everything kept is freed."""
    if cpu_kernels is None:
        yield
        return
    global _refusal_told
    if not cpu_kernels.reuse_step_memory(True, REUSE_KEPT_BYTES) and not _refusal_told:
        _refusal_told = True
        logger.warning("Host memory: torch's CPU allocator was replaced by one of higher priority, so freed "
                       "blocks are not reused within a training step (steps run ~1.6x slower)")
    try:
        yield
    finally:
        cpu_kernels.reuse_step_memory(False, 0)
