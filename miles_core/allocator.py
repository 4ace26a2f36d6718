"""Keep freed heap memory in a long-lived worker instead of handing it back to the kernel.

Found with the page-fault counters of an asynchronous run: the sampler process took
3.97 million minor page faults in 114 batches (35 thousand per batch; the learner beside it:
43 thousand in the whole run), and its rollouts were 45% slower than the same rollouts, token for
token, replayed in a process that also ran updates.

The cause is glibc's heap trimming. When more than ``M_TRIM_THRESHOLD`` bytes are free at the top
of the heap, ``free`` returns them to the kernel; by default that threshold is twice the largest
mmapped block freed so far, a few megabytes for the activations of one denoising step. A process
that only samples frees each step's activations, the heap shrinks, and the next step touches
fresh zeroed pages: a fault per 4 KiB, which is expensive under a hypervisor. A learner's bigger
backward buffers raise the dynamic threshold early, which is why only the sampler showed it.

Fixing both thresholds (which also turns glibc's dynamic adjustment off) keeps the working set
mapped: the same rollout loop alone went from 12,780 faults and 0.400 s per batch to 1 fault and
0.315 s. The price is that a worker keeps up to ``trim_bytes`` of freed memory for reuse.
Other C libraries (musl, macOS) have no ``mallopt``; there this does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses more than HEAP_MAX_SIZE / 2 on 64-bit


def retain_freed_memory(trim_bytes: int = 1 << 30, mmap_bytes: int = MMAP_THRESHOLD_MAX) -> bool:
    """Set glibc's trim threshold to ``trim_bytes`` and its mmap threshold to ``mmap_bytes`` for
    this process -> True if both were applied, False where the C library has no ``mallopt``."""
    if not 0 < mmap_bytes <= MMAP_THRESHOLD_MAX:
        raise ValueError(f"mmap_bytes must be in (0, {MMAP_THRESHOLD_MAX}], got {mmap_bytes}")
    if trim_bytes <= 0:
        raise ValueError(f"trim_bytes must be positive, got {trim_bytes}")
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    trim = min(trim_bytes, (1 << 31) - 1)  # mallopt takes an int
    return mallopt(M_MMAP_THRESHOLD, mmap_bytes) == 1 and mallopt(M_TRIM_THRESHOLD, trim) == 1


def apply_heap_setting(retain_heap_mb: int) -> bool:
    """``async_rl.retain_heap_mb`` for this process: 0 leaves glibc's default (-> False), any other
    value keeps that many MiB of freed heap (:func:`retain_freed_memory`). The one place the
    setting's meaning lives, for the workers and for benchmark arms that must run alike."""
    return retain_heap_mb > 0 and retain_freed_memory(retain_heap_mb << 20)
