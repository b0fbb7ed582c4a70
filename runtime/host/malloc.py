"""Freed memory kept in the process, so that a step's tensors do not fault in fresh pages every step.

Why: glibc's malloc serves a large request (above its mmap threshold, 128 KiB at start, raised as large
chunks are freed) with a fresh `mmap` and gives it back with `munmap` when freed, and it trims the top of
its heap back to the kernel once more than twice that threshold is free. A pipeline step allocates and
frees the same activations, gradients and messages again and again, so every step faults their pages in
anew and the kernel zeroes each one: on examples/unet_chain.py (p=4 m=8, 4 processes on this 2-core
machine) 25,000 minor faults and 53 ms of system time per step, against 17,000 and 23 ms for its stage
graph, the chain's carried skips being the difference; an op timed in a loop by `pipec profile` finds its
pages already there, so the simulator never saw that cost. With the mmap threshold at glibc's largest
(32 MiB) and trimming off, the faults after the first steps are none and the U-Net's step went from 0.23 to
0.27 s (14-step runs) down to 0.20 s for both systems (docs/runtime.md, "Freed memory kept", says how it
was measured).

Every process that runs or measures ranks sets it first (`pipec run`'s workers, `pipec profile` and its
spawned ranks), so profiles and runs see the same allocator. `PIPEC_MALLOC=system` leaves glibc's defaults;
glibc's own `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` in the environment win (a user's choice);
other C libraries (no `mallopt`) are left as they are. The memory is reused by the process, not lost: the
resident size stays at the step's peak instead of shrinking between steps.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 2**31 - 1  # an int: never trim in practice
_applied: str | None = None


def keep_freed_memory() -> str:
    """Set this process's malloc to keep freed memory (see the module docstring); what was done, in words
    (once per process: later calls return the first answer)."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> str:
    if os.environ.get("PIPEC_MALLOC", "") == "system":
        return "glibc's defaults (PIPEC_MALLOC=system)"
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return "the environment's MALLOC_*_THRESHOLD_"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "the C library's defaults (no mallopt)"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        return "freed memory kept: mmap threshold 32 MiB, no trimming (PIPEC_MALLOC=system for glibc's defaults)"
    return "the C library's defaults (mallopt refused)"
