"""macOS reads and drives: ``F_NOCACHE`` + ``pread``, free space and the drive's kind through macOS's own calls.

macOS has no O_DIRECT. ``F_NOCACHE`` on a descriptor keeps its reads (and writes) out of the unified buffer cache,
and ``F_RDAHEAD`` off stops the kernel reading ahead of a random expert read; neither asks anything of the buffer's
or the offset's alignment, so ``DarwinDriveReader`` reads any length at any offset into any writable buffer (no
4 KiB rounding). Many reads are in flight as on Linux: the reader pool's threads each block in their own ``pread``
(thread-safe, one descriptor per read). Data already in the cache (a file just written without F_NOCACHE) may still
be served from it, so files this engine writes to time a drive are written with F_NOCACHE too (``nocache``).

Drives: ``statfs(2)`` gives the volume's mount point (``/Volumes/NAME`` for an external drive, ``/`` or
``/System/Volumes/Data`` for the internal SSD), its filesystem type and its free blocks; ``diskutil info -plist``
gives whether it is solid state, its bus (Apple Fabric for the internal SSD, PCI-Express, Thunderbolt, USB) and its
device. Messages name the volume by its ``/Volumes`` name so a user sees which enclosure is meant.

Not yet run on a Mac: the tests take these branches on Linux with the OS calls stubbed (tests/test_darwin_io.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import plistlib
import subprocess
import sys
from dataclasses import dataclass

from deltafin.errors import DriveError, ReadError
from deltafin.io.direct import FileDriveReader

F_RDAHEAD, F_NOCACHE = 45, 48  # <sys/fcntl.h>
MNAMELEN, MFSTYPENAMELEN = 1024, 16  # <sys/mount.h>, 64-bit struct statfs (the only one on arm64)


def active() -> bool:
    """Whether the macOS branches run (read at each call, so tests can take them on Linux)."""
    return sys.platform == "darwin"


class StatFs(ctypes.Structure):
    """struct statfs of <sys/mount.h> with 64-bit inodes (macOS 10.6+; 2168 bytes)."""

    _fields_ = [("f_bsize", ctypes.c_uint32), ("f_iosize", ctypes.c_int32), ("f_blocks", ctypes.c_uint64),
                ("f_bfree", ctypes.c_uint64), ("f_bavail", ctypes.c_uint64), ("f_files", ctypes.c_uint64),
                ("f_ffree", ctypes.c_uint64), ("f_fsid", ctypes.c_int32 * 2), ("f_owner", ctypes.c_uint32),
                ("f_type", ctypes.c_uint32), ("f_flags", ctypes.c_uint32), ("f_fssubtype", ctypes.c_uint32),
                ("f_fstypename", ctypes.c_char * MFSTYPENAMELEN), ("f_mntonname", ctypes.c_char * MNAMELEN),
                ("f_mntfromname", ctypes.c_char * MNAMELEN), ("f_flags_ext", ctypes.c_uint32),
                ("f_reserved", ctypes.c_uint32 * 7)]


@dataclass(frozen=True, slots=True)
class Volume:
    mount: str  # where it is mounted: /Volumes/NAME, or / for the internal SSD
    fstype: str  # apfs, hfs, exfat, msdos, smbfs...
    device: str  # /dev/disk5s1
    free: int  # bytes an unprivileged writer may use
    io_size: int  # the filesystem's preferred transfer size

    @property
    def name(self) -> str:
        """The volume as a Mac user names it: /Volumes/NAME, or 'the internal SSD (/)'."""
        return self.mount if self.mount.startswith("/Volumes/") else f"the internal SSD ({self.mount})"


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def statfs(path: str) -> StatFs:
    """statfs(2) of the volume holding ``path`` (an existing path)."""
    buf = StatFs()
    libc = _libc()
    if libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        err = ctypes.get_errno()
        raise DriveError(f"{path}: statfs failed: {os.strerror(err)}; is the drive mounted? (ls /Volumes)")
    return buf


def volume(path: str) -> Volume:
    """The volume holding ``path`` (an existing path)."""
    s = statfs(path)
    return Volume(s.f_mntonname.decode(errors="replace"), s.f_fstypename.decode(errors="replace"),
                  s.f_mntfromname.decode(errors="replace"), int(s.f_bavail) * int(s.f_bsize), int(s.f_iosize))


@dataclass(frozen=True, slots=True)
class DriveKind:
    solid_state: bool | None  # None: diskutil did not say (a network or disk image volume)
    protocol: str  # Apple Fabric (internal), PCI-Express, Thunderbolt, USB, ... or '' when unknown
    internal: bool | None

    def describe(self) -> str:
        where = "internal" if self.internal else "external" if self.internal is False else ""
        ssd = "SSD" if self.solid_state else "not solid state" if self.solid_state is False else "unknown medium"
        return ", ".join(p for p in (where, self.protocol, ssd) if p)


def diskutil_info(target: str) -> dict:
    """``diskutil info -plist TARGET`` as a dict ({} where diskutil is missing or refuses the target)."""
    try:
        r = subprocess.run(["diskutil", "info", "-plist", target], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if r.returncode != 0 or not r.stdout:
        return {}
    try:
        return plistlib.loads(r.stdout)
    except Exception:  # plistlib raises several types on a damaged plist: treat all as "no answer"
        return {}


def drive_kind(path: str) -> DriveKind:
    """Whether the drive holding ``path`` is solid state, its bus, and whether it is the Mac's own."""
    info = diskutil_info(volume(path).mount)
    solid = info.get("SolidState")
    internal = info.get("Internal")
    return DriveKind(None if solid is None else bool(solid), str(info.get("BusProtocol", "")),
                     None if internal is None else bool(internal))


def nocache(fd: int) -> None:
    """Reads and writes of ``fd`` bypass the buffer cache (F_NOCACHE), with no read-ahead (F_RDAHEAD off)."""
    import fcntl

    fcntl.fcntl(fd, F_NOCACHE, 1)
    fcntl.fcntl(fd, F_RDAHEAD, 0)


def _where(path: str) -> str:
    """The volume of ``path`` for a message: /Volumes/NAME, or '' when statfs cannot say."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)
    try:
        return volume(p).name
    except DriveError:
        return ""


def unmounted(path: str) -> str:
    """The /Volumes/NAME a path lies under when that volume is not mounted (its folder is missing or is only a
    folder of the internal disk), else ''."""
    parts = os.path.abspath(path).split(os.sep)
    if len(parts) < 3 or parts[1] != "Volumes" or not parts[2]:
        return ""
    vol = os.sep.join(parts[:3])
    try:
        return "" if os.path.isdir(vol) and volume(vol).mount == vol else vol
    except DriveError:
        return vol


class DarwinDriveReader(FileDriveReader):
    """``DriveReader`` of one macOS drive: each read opens the file with F_NOCACHE and read-ahead off and preads
    (os.preadv, macOS 11+) straight into the caller's buffer, any address, length and offset; ``direct`` is always
    True (F_NOCACHE works on every local filesystem)."""

    def __init__(self, label: str, root: str, direct: bool = True):
        self.label, self.root, self.direct = label, root, True
        self.volume = _where(root)

    def _name(self) -> str:
        return f"drive {self.label}" + (f" ({self.volume})" if self.volume else "")

    def _open(self, path: str) -> int:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            hint = "; is the drive connected? (ls /Volumes)" if e.errno == 2 and self.volume.startswith("/Volumes/") \
                else ""
            raise ReadError(f"{self._name()}: cannot open {path}: {e.strerror}{hint}") from e
        try:
            nocache(fd)
        except OSError as e:
            os.close(fd)
            raise ReadError(f"{self._name()}: F_NOCACHE refused on {path}: {e.strerror}") from e
        return fd

    def read_into(self, path: str, offset: int, buf: memoryview) -> int:
        try:
            return super().read_into(path, offset, buf)
        except ReadError as e:  # the read loop's message, with the volume's name
            raise ReadError(str(e).replace(f"drive {self.label}:", f"{self._name()}:", 1)) from e
