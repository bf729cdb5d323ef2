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


def available_bytes(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int:
    """Memory this process can still take: the system's available RAM, or less where a cgroup memory limit (v2 or v1;
    the process's own group and every group above it) leaves less: the limit less what the group uses, its inactive
    file pages (page cache the kernel reclaims first) not counted as used. In a container with ``--memory 8g`` on a
    64 GB machine the expert cache is sized from the 8 GB, not the 64 (a cache sized from the machine's RAM is
    killed at the limit)."""
    import psutil

    free = psutil.virtual_memory().available
    for limit, used in _cgroup_limits(proc, root):
        free = min(free, max(limit - used, 0))
    return free


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            raw = f.read().strip()
    except OSError:
        return None
    return int(raw) if raw.isdigit() else None  # v2's "max": no limit


def _stat(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_limits(proc: str, root: str) -> list[tuple[int, int]]:
    """(limit, used) of every memory cgroup over this process that sets a limit, innermost first."""
    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2, the unified hierarchy
            base, names = root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base, names = os.path.join(root, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                         "total_inactive_file")
        else:
            continue
        rel = path.strip("/")
        while True:
            d = os.path.join(base, rel) if rel else base
            limit, used = _read_int(os.path.join(d, names[0])), _read_int(os.path.join(d, names[1]))
            if limit is not None and used is not None and limit < 1 << 60:  # v1 writes "no limit" as ~2^63
                out.append((limit, max(used - _stat(os.path.join(d, "memory.stat"), names[2]), 0)))
            if not rel:
                break
            rel = os.path.dirname(rel)
    return out
