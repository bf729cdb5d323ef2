"""Drives given on the command line: parsing, write checks, free space, and a short read-rate probe."""

from __future__ import annotations

import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from deltafin.errors import DriveError, NotEnoughSpaceError, UsageError
from deltafin.io import darwin
from deltafin.io.direct import FileDriveReader, aligned_buffer

PROBE_BYTES = 256 << 20
PROBE_READ = 4 << 20


@dataclass(frozen=True, slots=True)
class DriveArg:
    label: str
    path: str
    gbps: float | None  # None: measure


def parse_drive(arg: str, index: int) -> DriveArg:
    """'PATH[=GBPS]', optionally 'LABEL:PATH[=GBPS]' with a label of letters, digits, '-' and '_'."""
    spec, sep, rate = arg.rpartition("=") if "=" in arg else (arg, "", "")
    label = f"d{index}"
    head, colon, tail = spec.partition(":")
    if colon and head and head.replace("-", "").replace("_", "").isalnum() and not head.startswith("/"):
        label, spec = head, tail
    if not spec:
        raise UsageError(f"--drive {arg!r}: expected PATH[=GBPS] (e.g. /mnt/ssd1=6.5) or LABEL:PATH[=GBPS]")
    gbps = None
    if sep:
        try:
            gbps = float(rate)
        except ValueError:
            raise UsageError(f"--drive {arg!r}: read rate {rate!r} is not a number of GB/s (e.g. =6.5)") from None
        if not math.isfinite(gbps) or gbps <= 0:
            raise UsageError(f"--drive {arg!r}: read rate {rate!r} must be a finite, positive number of GB/s (e.g. =6.5)")
    return DriveArg(label, os.path.abspath(spec), gbps)


def parse_drives(args: list[str]) -> list[DriveArg]:
    out = [parse_drive(a, i) for i, a in enumerate(args)]
    labels = [d.label for d in out]
    if len(set(labels)) != len(labels):
        raise UsageError(f"--drive labels must be unique, got {labels}")
    paths = [os.path.realpath(d.path) for d in out]
    if len(set(paths)) != len(paths):
        raise UsageError(f"--drive paths must be distinct, got {[d.path for d in out]}")
    return out


def ensure_writable(path: str, label: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".deltafin-write-probe-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"x")
        os.unlink(probe)
    except OSError as e:
        raise DriveError(f"drive {label} ({path}) is not writable: {e.strerror}; check the mount and permissions") from e


def _existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return p


def free_bytes(path: str) -> int:
    if darwin.active():  # statfs's f_bavail: what an unprivileged writer may use on the APFS container
        return darwin.volume(_existing(path)).free
    return shutil.disk_usage(_existing(path)).free


def filesystem(path: str) -> int:
    """The device id of the filesystem that holds ``path`` (or would, once created)."""
    return os.stat(_existing(path)).st_dev


def mount_point(path: str) -> str:
    if darwin.active():
        return darwin.volume(_existing(path)).mount
    p = os.path.realpath(_existing(path))
    dev = os.stat(p).st_dev
    while p != os.path.dirname(p) and os.stat(os.path.dirname(p)).st_dev == dev:
        p = os.path.dirname(p)
    return p


def require_drives(drives: list[DriveArg], create: bool, plan: bool = False) -> None:
    """Every --drive must be an existing, writable folder, so that a mistyped or unmounted path is never
    packed into (it would fill whatever disk holds its parent). ``create`` makes missing ones (not for a plan)."""
    for d in drives:
        if os.path.exists(d.path) and not os.path.isdir(d.path):
            raise DriveError(f"drive {d.label}: {d.path} is a file, not a folder; give the drive's folder")
        if not os.path.isdir(d.path):
            if darwin.active() and (vol := darwin.unmounted(d.path)):
                raise DriveError(f"drive {d.label}: {d.path} is on {vol}, which is not mounted; connect the drive "
                                 "(ls /Volumes lists what is) or give another folder")
            if not create:
                raise DriveError(f"drive {d.label}: {d.path} does not exist; is the drive mounted? Give an existing "
                                 f"folder, or pass --create to make it (on {mount_point(d.path)})")
            if not plan:
                ensure_writable(d.path, d.label)
        elif not plan:
            ensure_writable(d.path, d.label)
        elif not os.access(d.path, os.W_OK):
            raise DriveError(f"drive {d.label}: {d.path} is not writable; check the mount and permissions")


def shared_filesystems(drives: list[DriveArg]) -> list[list[DriveArg]]:
    """Groups of two or more drives that are folders on one filesystem (one device: shared space and speed)."""
    groups: dict[int, list[DriveArg]] = {}
    for d in drives:
        groups.setdefault(filesystem(d.path), []).append(d)
    return [g for g in groups.values() if len(g) > 1]


def shared_warning(group: list[DriveArg]) -> str:
    return (f"drives {', '.join(d.label for d in group)} are folders on one filesystem ({mount_point(group[0].path)}): "
            f"they share its free space and read rate, which count once; for more speed use separate drives")


def _size(n: int) -> str:
    from deltafin import fmt

    return f"{n:,} bytes ({fmt.size(n)})" if n >= 1e7 else f"{n:,} bytes"


def check_space(needs: dict[str, tuple[str, int]]) -> None:
    """needs: label -> (path, bytes still to write). Drives that are folders on one filesystem are checked
    together against its free space, counted once. Raises naming every filesystem that is short."""
    by_fs: dict[int, list[tuple[str, str, int]]] = {}
    for label, (path, need) in needs.items():
        by_fs.setdefault(filesystem(path), []).append((label, path, need))
    short = []
    for group in by_fs.values():
        need, have = sum(n for _, _, n in group), min(free_bytes(path) for _, path, _ in group)
        if need > have:
            who = (f"drive {group[0][0]} ({group[0][1]})" if len(group) == 1 else
                   f"drives {', '.join(lb for lb, _, _ in group)} (one filesystem, {mount_point(group[0][1])})")
            short.append(f"{who} needs {_size(need)}, has {_size(have)} free")
    if short:
        raise NotEnoughSpaceError("not enough space: " + "; ".join(short) + ". Free space, add drives, or give "
                                  "faster drives a smaller share")


def probe_read_gbps(path: str, label: str, nbytes: int = PROBE_BYTES, depth: int = 8, progress=None) -> float:
    """Direct-read rate of the drive holding ``path``: write a probe file, read it back with O_DIRECT.
    ``progress(nbytes)`` is told of every write and read (2 x ``nbytes`` in all)."""
    progress = progress or (lambda n: None)
    ensure_writable(path, label)
    f = os.path.join(path, f".deltafin-probe-{os.getpid()}")
    chunk = os.urandom(1 << 20) * (PROBE_READ >> 20)
    try:
        with open(f, "wb") as fh:
            if darwin.active():  # written past the cache, so the reads below come from the drive
                darwin.nocache(fh.fileno())
            for _ in range(nbytes // len(chunk)):
                fh.write(chunk)
                progress(len(chunk))
            fh.flush()
            os.fsync(fh.fileno())
        reader = FileDriveReader(label, path)
        bufs = [aligned_buffer(PROBE_READ) for _ in range(depth)]
        offsets = list(range(0, nbytes, PROBE_READ))

        def work(i: int) -> int:
            buf = bufs[i % depth]
            got = 0
            for off in offsets[i::depth]:
                n = reader.read_into(f, off, buf)
                progress(n)
                got += n
            return got

        t0 = time.perf_counter()
        with ThreadPoolExecutor(depth) as ex:
            total = sum(ex.map(work, range(depth)))
        dt = time.perf_counter() - t0
        return total / dt / 1e9
    finally:
        try:
            os.unlink(f)
        except OSError:
            pass


def measured_rates(drives: list[DriveArg]) -> dict[str, float]:
    """label -> GB/s from one probe per filesystem, split equally over the folders that share it."""
    groups: dict[int, list[DriveArg]] = {}
    for d in drives:
        groups.setdefault(filesystem(d.path), []).append(d)
    from deltafin.progress import bar

    out = {}
    for group in groups.values():
        with bar(2 * PROBE_BYTES, f"measuring drive {group[0].label}") as b:
            gbps = probe_read_gbps(group[0].path, group[0].label, progress=b.update)
        out |= {d.label: gbps / len(group) for d in group}
    return out
