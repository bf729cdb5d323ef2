"""Direct reads into aligned, reusable buffers, and the reader interface every drive implements.

A ``DriveReader`` serves one drive. ``read_into(path, offset, buf)`` fills ``buf`` (a writable,
4 KiB-aligned memoryview whose length is a multiple of 4 KiB) from ``path`` at ``offset`` and returns
the number of bytes read. Real drives use O_DIRECT (Linux) or F_NOCACHE (macOS); the emulator
(``deltafin.io.emulator``) implements the same interface with modelled timing.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import threading
from typing import Protocol

from deltafin.errors import ReadError

ALIGN = 4096
MAX_IO = 1 << 30  # bytes per system call: Linux moves at most 2,147,479,552 per read; 4 KiB-aligned


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


HUGE = 2 << 20  # a transparent huge page (x86-64, arm64 with 4 KiB pages)


def aligned_buffer(nbytes: int, populate: bool = False, huge: bool = False) -> memoryview:
    """A page-aligned, zero-filled writable buffer (private anonymous mmap: always 4 KiB aligned).

    ``populate``: its pages are mapped now (MAP_POPULATE where the platform has it, else a write to every page)
    rather than one fault at a time at first touch, which a direct read into a fresh buffer pays inside the read
    (1.26 GB here: 0.37-0.40 s populated at once, 0.5-0.6 s touched page by page, 0.7 s as a shared mapping).

    ``huge``: memory the kernels stream (experts held in the cache, trunk matrices): its whole 2 MiB pages are
    asked for as transparent huge pages (``madvise(MADV_HUGEPAGE)``, Linux; where THP is off, or elsewhere, plain
    pages), the tail past the last whole one left in small pages so no huge page is spent on a few bytes. A
    one-token MXFP4 expert read from 4 KiB pages ran 8.9 GB/s on one Zen 4 core and 15.1 from huge pages, int8
    rows 20.2 and 25.9 (docs/KERNELS.md): the hardware prefetcher stops at every 4 KiB page and the TLB misses."""
    size = max(align_up(nbytes), ALIGN)
    advise = huge and size >= HUGE and hasattr(mmap, "MADV_HUGEPAGE")
    if not hasattr(mmap, "MAP_PRIVATE"):  # Windows: no flags; the mapping is private to the process anyway
        buf = memoryview(mmap.mmap(-1, size))
    else:
        # a length of whole huge pages makes Linux (6.7 on) start the mapping on a huge-page boundary
        flags = mmap.MAP_PRIVATE | (getattr(mmap, "MAP_POPULATE", 0) if populate and not advise else 0)
        m = mmap.mmap(-1, align_up(size, HUGE) if advise else size, flags=flags)
        if advise:
            start = (-_address(m)) % HUGE  # the first whole huge page
            whole = (size - start) // HUGE * HUGE if size > start else 0
            if whole:
                with contextlib.suppress(OSError):  # THP compiled out: plain pages
                    m.madvise(mmap.MADV_HUGEPAGE, start, whole)
        buf = memoryview(m)[:size]
    if populate and (advise or not getattr(mmap, "MAP_POPULATE", 0)):
        buf[::ALIGN] = bytes(size // ALIGN)  # one write per page maps it (zeros: the contents stay)
    return buf


def _address(m: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(m))


class DriveReader(Protocol):
    label: str
    direct: bool  # False when the filesystem refused direct I/O and buffered reads are used

    def read_into(self, path: str, offset: int, buf: memoryview) -> int: ...


class FileDriveReader:
    """Reads files of one drive with direct I/O where the filesystem allows it.

    Falls back to buffered reads (and says so through ``direct = False``) on filesystems that refuse
    O_DIRECT, such as tmpfs. ``maps`` (``io.mapped.FileMaps``, set by the expert source on a drive in memory):
    the reader pool takes a file's mapped pages in place of reading it.
    """

    maps = None

    def __new__(cls, *args, **kwargs):
        if cls is FileDriveReader and sys.platform == "darwin":  # F_NOCACHE + pread, any alignment
            from deltafin.io.darwin import DarwinDriveReader

            return DarwinDriveReader(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, label: str, root: str, direct: bool = True):
        self.label = label
        self.root = root
        self.direct = direct and _supports_direct(root)

    def _open(self, path: str) -> int:
        flags = os.O_RDONLY
        if self.direct and sys.platform.startswith("linux"):
            flags |= os.O_DIRECT
        try:
            fd = os.open(path, flags)
        except OSError as e:
            raise ReadError(f"drive {self.label}: cannot open {path}: {e.strerror}") from e
        if self.direct and sys.platform == "darwin":
            import fcntl

            fcntl.fcntl(fd, 48, 1)  # F_NOCACHE
        return fd

    def read_into(self, path: str, offset: int, buf: memoryview) -> int:
        fd = self._open(path)
        try:
            total = 0
            n = len(buf)
            while total < n:
                want = min(n - total, MAX_IO)
                try:
                    got = os.preadv(fd, [buf[total : total + want]], offset + total)
                except OSError as e:
                    raise ReadError(f"drive {self.label}: read of {want:,} bytes of {path} at offset "
                                    f"{offset + total:,} failed: {e.strerror}") from e
                if got == 0:
                    break
                total += got
            return total
        finally:
            os.close(fd)


def _supports_direct(root: str) -> bool:
    """Probe once whether files under ``root`` accept O_DIRECT."""
    if not sys.platform.startswith("linux"):
        return sys.platform == "darwin"
    probe = os.path.join(root, f".deltafin-odirect-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * ALIGN)
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [aligned_buffer(ALIGN)], 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass


def read_file(reader: DriveReader, path: str, nbytes: int, buf: memoryview | None = None) -> memoryview:
    """Read a whole file of ``nbytes`` (a multiple of 4 KiB) and check it came back complete."""
    buf = buf if buf is not None else aligned_buffer(nbytes)
    view = buf[: align_up(nbytes)]
    got = reader.read_into(path, 0, view)
    if got < nbytes:
        raise ReadError(f"drive {reader.label}: short read of {path}: got {got} of {nbytes} bytes; "
                        f"the file is truncated: run 'deltafin verify' and repack the bad experts")
    return view[:nbytes]
