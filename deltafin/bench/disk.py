"""Raw rates of the disk under a folder, measured in the same run as the figure they bound."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

from deltafin.io.direct import FileDriveReader, aligned_buffer

CHUNK = 16 << 20


def raw_write_gbps(folder: str, nbytes: int, threads: int = 1) -> float:
    """Direct sequential writes of ``nbytes`` in 16 MiB chunks over ``threads`` files, then fsync."""
    buf = aligned_buffer(CHUNK)
    buf[:] = os.urandom(CHUNK)
    per = max(nbytes // CHUNK // threads, 1)

    def one(i: int) -> int:
        path = os.path.join(folder, f".deltafin-bench-write-{os.getpid()}-{i}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
        except OSError:  # filesystems without direct I/O
            fd = os.open(path, flags, 0o644)
        try:
            for _ in range(per):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(path)
        return per * CHUNK

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        total = sum(ex.map(one, range(threads)))
    return total / (time.perf_counter() - t0) / 1e9


def raw_read_gbps(paths: list[str], nbytes: int, threads: int, label: str = "disk") -> float:
    """Direct reads of whole files (``nbytes`` each) with ``threads`` in flight: the read ceiling."""
    reader = FileDriveReader(label, os.path.dirname(paths[0]))
    bufs = [aligned_buffer(nbytes) for _ in range(threads)]

    def work(i: int) -> int:
        return sum(reader.read_into(p, 0, bufs[i]) for p in paths[i::threads])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        total = sum(ex.map(work, range(threads)))
    return total / (time.perf_counter() - t0) / 1e9
