"""Host memory for the CPU forward pass: freed blocks kept for reuse instead of handed back to the kernel.

A prefill at a large model's widths makes and drops many tensors of tens of MB ([512, 33792] float32 is 69 MB).
glibc's malloc maps every block past its mmap threshold (at most 32 MB) fresh and unmaps it when freed, so
each such tensor faults its pages in again, and the kernel zeroes every page it hands out: on a 2-core VM
that was 35 ms of system time per tanh of a [512, 33792] tensor (8.6 ms in all once the blocks were reused),
and page zeroing the largest single item of a Kimi K3 slice's prefill. ``keep_freed_memory`` has malloc serve
every block from its heap and never trim it: the process keeps its peak of freed memory (reused by the next
layer's tensors) in exchange.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
_done = False


def keep_freed_memory() -> bool:
    """Once per process on Linux with glibc: no mmap for large blocks, no trimming of the heap. Skipped where the
    user tunes malloc (GLIBC_TUNABLES, MALLOC_* variables) or sets DELTAFIN_KEEP_FREED_MEMORY=0. Returns
    whether it applied."""
    global _done
    if _done:
        return True
    if (not sys.platform.startswith("linux") or os.environ.get("DELTAFIN_KEEP_FREED_MEMORY", "1") == "0"
            or "GLIBC_TUNABLES" in os.environ or any(k.startswith("MALLOC_") for k in os.environ)):
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        mallopt = ctypes.CDLL(None).mallopt
    except (ValueError, OSError, AttributeError):  # not glibc (musl, ...): its own allocator, left alone
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    return _done
