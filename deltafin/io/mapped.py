"""Expert files on a drive that is memory (tmpfs, ramfs): mapped, not copied.

A read from such a drive is the kernel copying pages that are already in memory into a read buffer: a read and a
write of every byte before the math reads it again. Mapped, the file's own pages are the landed bytes: the checksum
and the CPU's math read them where they are, and on CUDA the slab copy is a DMA straight from them (each file's
mapping is page-locked once, read-only, with ``cudaHostRegister``). Mapped reads keep what reads give: the same
bytes, checked against the same checksums, failover to a replica on a mismatch. ``DELTAFIN_MAP_FILES=0`` reads
such drives like any other.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading

log = logging.getLogger("deltafin.io")

MAP_FILES = os.environ.get("DELTAFIN_MAP_FILES", "1") != "0"
# Mappings held at once per drive, well under Linux's default vm.max_map_count (65,530 for the whole process):
# past it a drive's other files are read as on any drive.
MAX_MAPPED = 16384
_MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}  # statfs f_type magic numbers (linux/magic.h)
_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: pin pages the process may not write
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux


def memory_fs(root: str) -> str | None:
    """The name of the in-memory filesystem ``root`` is on ("tmpfs", "ramfs"), else None (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
        if libc.statfs(os.fsencode(root), buf) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return _MEMORY_FS.get(ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF)


class FileMaps:
    """Read-only shared mappings of one drive's files, made at first use and kept until ``close``. With ``cuda`` set
    each is page-locked when made, so device copies from it are DMA; where that fails (no support for read-only
    registration, a memory-lock limit) the drive goes back to reads, said once in the log."""

    def __init__(self, label: str, limit: int = MAX_MAPPED):
        self.label, self.limit = label, limit
        self.cuda = False
        self.off: str | None = None  # why mapping stopped (the drive reads from then on)
        # path -> (mapping, its view, page-locked address or None, the file's identity when mapped)
        self._maps: dict[str, tuple[mmap.mmap, memoryview, int | None, tuple]] = {}
        self._replaced: list[int | None] = []  # page-locked addresses of mappings of files since replaced
        self._lock = threading.Lock()

    def view(self, path: str, nbytes: int, new: bool = True) -> memoryview | None:
        """The first ``nbytes`` of ``path`` as a read-only view of its pages, or None (read it instead: the file is
        shorter, the mapping limit is reached, mapping is off). A file replaced since it was mapped (a repack writes
        a new file and renames it over the old) is mapped again: a stat a read, against the inode, size and
        modification time the mapping was made from. ``new=False``: None where the file is not mapped yet."""
        try:
            ident = _identity(os.stat(path))
        except OSError:
            return None  # the read names the error
        with self._lock:
            got = self._maps.get(path)
            if got is not None and got[3] != ident:
                self._replaced.append(self._maps.pop(path)[2])  # its views (cached tensors) keep the old pages
                got = None
            if got is None and (not new or self.off is not None or len(self._maps) >= self.limit):
                return None
        if got is None:
            got = self._map(path)
            if got is None:
                return None
        return got[1][:nbytes] if len(got[1]) >= nbytes else None

    def _map(self, path: str) -> tuple | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None  # the read names the error
        try:
            st = os.fstat(fd)
            if st.st_size == 0:
                return None
            # page tables filled now: a fresh mapping's first touch faults every 64 KiB, which halved the first hash's
            # rate (7-8 against 15-25 GB/s a core, 18 MB files, this 2-core VM). Page-locking (CUDA) fills them itself.
            flags = mmap.MAP_SHARED | (0 if self.cuda else _POPULATE)
            m = mmap.mmap(fd, st.st_size, flags=flags, prot=mmap.PROT_READ)
        except OSError:
            return None
        finally:
            os.close(fd)
        mv = memoryview(m)
        ptr = None
        if self.cuda:
            ptr, why = _register(mv)
            if ptr is None:
                self._stop(f"page-locking its mappings failed ({why})")
                mv.release()
                m.close()
                return None
        with self._lock:
            if path in self._maps:  # another thread mapped it meanwhile: keep theirs
                kept = self._maps[path]
            else:
                self._maps[path] = kept = (m, mv, ptr, _identity(st))
                return kept
        _unregister(ptr)
        mv.release()
        m.close()
        return kept

    def _stop(self, why: str) -> None:
        with self._lock:
            if self.off is None:
                self.off = why
                log.warning("drive %s: files in memory are read, not mapped: %s; raise the memory-lock limit "
                            "(ulimit -l) to map them, or set DELTAFIN_MAP_FILES=0 to read them without trying",
                            self.label, why)

    @property
    def mapped(self) -> int:
        return len(self._maps)

    def close(self) -> None:
        """Unpin every mapping; each is unmapped once the last view of it (a cached expert's tensors) is gone."""
        with self._lock:
            maps, self._maps = self._maps, {}
            replaced, self._replaced = self._replaced, []
        for ptr in [m[2] for m in maps.values()] + replaced:
            _unregister(ptr)


def _identity(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _register(mv: memoryview) -> tuple[int | None, str]:
    """(address, "") of ``mv`` page-locked for CUDA (read-only), or (None, why not)."""
    import numpy as np
    import torch

    ptr = int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)
    try:
        rt = torch.cuda.cudart()
        size = -(-len(mv) // mmap.PAGESIZE) * mmap.PAGESIZE  # the mapping's whole pages (it starts on one)
        err = rt.cudaHostRegister(ptr, size, _HOST_REGISTER_READ_ONLY)
    except (AttributeError, RuntimeError, AssertionError) as e:
        return None, str(e)
    if int(err) != 0:
        return None, f"cudaHostRegister: CUDA error {int(err)}"
    return ptr, ""


def _unregister(ptr: int | None) -> None:
    if ptr is None:
        return
    import torch

    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except (AttributeError, RuntimeError):
        pass
