"""Reads and writes of any size that loop to completion or fail naming the file, the offset and the bytes.

One ``pread``/``preadv``/``write`` moves at most 2,147,479,552 bytes on Linux (and INT_MAX on macOS), so
every transfer here goes in calls of at most ``MAX_IO`` bytes and carries on after short counts.
"""

from __future__ import annotations

import errno
import os

from deltafin.errors import DeltafinError, DriveError, NotEnoughSpaceError
from deltafin.io.direct import MAX_IO


def pread_full(fd: int, buf: memoryview, offset: int, path: str, error: type[DeltafinError]) -> int:
    """Fill ``buf`` from ``fd`` at ``offset``; returns the bytes read (fewer only at the end of the file).
    An OS error becomes ``error`` naming ``path``, the offset and the bytes asked for."""
    total, n = 0, len(buf)
    while total < n:
        want = min(n - total, MAX_IO)
        try:
            got = os.preadv(fd, [buf[total : total + want]], offset + total)
        except OSError as e:
            raise error(f"{path}: read of {want:,} bytes at offset {offset + total:,} failed: {e.strerror}") from e
        if got == 0:
            break
        total += got
    return total


def read_exact(path: str, buf: memoryview, offset: int, error: type[DeltafinError], fix: str,
               what: str | None = None) -> None:
    """Fill ``buf`` from ``path`` at ``offset``, or raise ``error`` naming the file, offset and bytes (and
    ``what`` was being read, e.g. a tensor)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise error(f"{path}: cannot open ({e.strerror}); {fix}") from e
    try:
        got = pread_full(fd, buf, offset, path, error)
    finally:
        os.close(fd)
    if got != len(buf):
        of = f" of {what}" if what else ""
        raise error(f"{path}: short read{of} at offset {offset + got:,} ({got:,} of {len(buf):,} bytes; the file "
                    f"ends early); {fix}")


def write_full(fd: int, data: memoryview, path: str, offset: int | None = None) -> None:
    """Write all of ``data`` (at ``offset``, else at the file position); a full disk becomes
    ``NotEnoughSpaceError`` naming the file and what was left unwritten."""
    view = memoryview(data).cast("B")
    done, n = 0, len(view)
    while done < n:
        part = view[done : done + MAX_IO]
        try:
            got = os.write(fd, part) if offset is None else os.pwrite(fd, part, offset + done)
        except OSError as e:
            at = f" at offset {(offset or 0) + done:,}" if offset is not None else f" after {done:,} bytes"
            raise write_error(e, path, f"writing {n - done:,} bytes{at}") from e
        if got == 0:
            raise DriveError(f"{path}: write made no progress with {n - done:,} bytes left")
        done += got


def write_error(e: OSError, path: str, doing: str) -> DriveError:
    """A typed error for a failed write, create or flush: a full disk says how to carry on."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return NotEnoughSpaceError(f"{path}: disk full {doing}; free space (or add a drive) and re-run the same "
                                   f"command: it resumes where it stopped")
    return DriveError(f"{path}: {doing} failed: {e.strerror}")


def return_freed_memory() -> None:
    """Make large allocations come straight from the OS and go back to it when freed (glibc).

    glibc raises its mmap threshold each time a large block is freed, after which blocks of a few MB
    come from the heap and stay there: converting a 2.35 GB tensor a 32 MB block at a time then grew the
    process by about the tensor's size. A fixed threshold (setting it turns the raising off) keeps pack's
    memory at the blocks in hand."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 1 MiB
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        pass


def peak_rss_bytes() -> int:
    """This process's peak resident memory: VmHWM where Linux has it (ru_maxrss also counts the memory
    of the parent at fork time, carried across exec), else ru_maxrss."""
    import resource
    import sys

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def file_sha256(path: str) -> str:
    """sha256 of a small file (config, tokenizer), read in blocks."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
