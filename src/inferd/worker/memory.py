"""What a model's load costs in memory, measured in the worker process, and giving memory back.

Device memory where there is a device (torch's CUDA allocator, once torch has initialized CUDA in this
process), else the process's resident memory (/proc/self/statm). A pool worker (worker/pool.py) reads
`used_mb` before a load and after its warm-up; the difference is the model's size from then on.

Resident memory tells a load's cost only when an unloaded model's memory goes back to the system: a
pool worker pins glibc's mmap threshold at start (`return_large_frees`), see there.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

MIB = 2**20


@dataclass(frozen=True)
class Reading:
    """Memory in use at one moment: resident MiB, and device MiB (None: no device initialized)."""

    resident_mb: float
    device_mb: float | None

    def grown_to(self, after: Reading) -> float:
        """MiB the process took between this reading and `after`: on the device when one is in use after,
        else resident (never below 0: a load that freed more than it took costs nothing)."""
        if after.device_mb is not None:
            return max(0.0, after.device_mb - (self.device_mb or 0.0))
        return max(0.0, after.resident_mb - self.resident_mb)


def resident_mb() -> float:
    """The process's resident set in MiB (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / MIB


def device_mb() -> float | None:
    """MiB torch's CUDA allocator holds for tensors, when torch was imported and has initialized CUDA here
    (never imports torch, nor initializes CUDA)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return float(torch.cuda.memory_allocated()) / MIB


def reading() -> Reading:
    return Reading(resident_mb(), device_mb())


def give_back() -> None:
    """After an unload: collect what the model's objects held, release CUDA's cached blocks, and hand the C
    allocator's free memory back to the system (glibc's malloc_trim), so resident memory shrinks."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


MMAP_THRESHOLD = 128 * 1024
"""Allocations from this size up are mmapped (glibc's own initial threshold, pinned)."""
_M_MMAP_THRESHOLD = -3
"""mallopt's parameter number for the threshold (malloc.h)."""


def return_large_frees() -> bool:
    """Pin glibc's mmap threshold (a pool worker, at start): every allocation of MMAP_THRESHOLD or more is
    mmapped, and unmapped when freed, so an unloaded model's buffers leave resident memory at once.

    Why: glibc raises the threshold each time an mmapped chunk is freed (up to 32 MiB), after which
    model-sized buffers come from its arenas; memory freed there stays resident until a trim, and in a
    pool worker even `give_back`'s malloc_trim at times left it so. The next load then reused it without
    resident memory growing: it measured as costing nothing, and the worker held more than its budget
    (seen: a 50 MiB sim model measured at 0.0 MiB after another was evicted, and three held where two
    fit). The price: each large allocation is a fresh mapping (its pages faulted in on first touch).
    False where mallopt is not there (musl, macOS)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, from the symbols the process has loaded (None elsewhere: musl, macOS)."""
    return getattr(ctypes.CDLL(None), "malloc_trim", None)
