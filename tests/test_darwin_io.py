"""The macOS read path and drive probes (deltafin/io/darwin.py), on Linux with the darwin branches taken:
sys.platform reads 'darwin', and the OS calls that only macOS has (fcntl's F_NOCACHE and F_RDAHEAD, statfs(2)'s
64-bit struct, diskutil) are stubbed with what macOS returns. pread itself is the real call."""

from __future__ import annotations

import ctypes
import os
import plistlib
import subprocess
import sys
import threading

import pytest

from deltafin.errors import DriveError, ReadError
from deltafin.io import darwin, direct
from deltafin.store import drives


class FakeLibc:
    """statfs(2) as macOS answers it: each mounted volume by its mount point (the longest prefix of the path)."""

    def __init__(self, mounts: dict[str, dict]):
        self.mounts, self.calls = mounts, []

    def statfs(self, path: bytes, ref) -> int:
        p = os.fsdecode(path)
        self.calls.append(p)
        hit = max((m for m in self.mounts if p == m or p.startswith(m.rstrip("/") + "/")), key=len, default=None)
        if hit is None:
            ctypes.set_errno(2)
            return -1
        s, v = ref._obj, self.mounts[hit]
        s.f_bsize, s.f_iosize, s.f_bavail = 4096, 1 << 20, v["free"] // 4096
        s.f_fstypename, s.f_mntonname, s.f_mntfromname = v["fs"].encode(), hit.encode(), v["dev"].encode()
        return 0


@pytest.fixture
def mac(monkeypatch, tmp_path):
    """A Mac with the internal SSD at / and an external APFS drive whose mount point is tmp_path (so real files lie
    under it); fcntl records its calls."""
    monkeypatch.setattr(sys, "platform", "darwin")
    mounts = {"/": {"free": 500 << 30, "fs": "apfs", "dev": "/dev/disk3s1s1"},
              str(tmp_path): {"free": 3 << 40, "fs": "apfs", "dev": "/dev/disk5s1"}}
    libc = FakeLibc(mounts)
    monkeypatch.setattr(darwin, "_libc", lambda: libc)
    calls = []
    import fcntl

    monkeypatch.setattr(fcntl, "fcntl", lambda fd, cmd, arg=0: calls.append((fd, cmd, arg)) or 0)
    return {"root": tmp_path, "fcntl": calls, "libc": libc, "mounts": mounts}


def test_statfs_struct_is_macos_64_bit_layout():
    """The fields sit where <sys/mount.h> puts them (a wrong offset would read names out of the block counts)."""
    assert ctypes.sizeof(darwin.StatFs) == 2168
    assert darwin.StatFs.f_bavail.offset == 24 and darwin.StatFs.f_fstypename.offset == 72
    assert darwin.StatFs.f_mntonname.offset == 88 and darwin.StatFs.f_mntfromname.offset == 1112


def test_reader_takes_f_nocache_and_reads_any_alignment(mac):
    """On macOS the drive reader is the F_NOCACHE one: every descriptor gets F_NOCACHE on and read-ahead off, and a
    read lands at any address, length and offset (no O_DIRECT rounding), bytes equal to the file's."""
    data = os.urandom(3 * 4096 + 123)
    f = mac["root"] / "E0001.dfx"
    f.write_bytes(data)
    r = direct.FileDriveReader("d1", str(mac["root"]))
    assert isinstance(r, darwin.DarwinDriveReader) and r.direct
    backing = bytearray(9000)
    view = memoryview(backing)[7 : 7 + 5001]  # an odd address and length
    assert r.read_into(str(f), 77, view) == 5001
    assert bytes(view) == data[77 : 77 + 5001]
    assert [(c, a) for _, c, a in mac["fcntl"]] == [(darwin.F_NOCACHE, 1), (darwin.F_RDAHEAD, 0)]
    tail = memoryview(bytearray(4096))
    assert r.read_into(str(f), len(data) - 100, tail) == 100  # past the end: what is there
    view = direct.read_file(r, str(f), len(data))
    assert bytes(view) == data


def test_many_reads_in_flight_from_threads(mac):
    """Reads from many threads at once through one reader (the pool's model: each thread in its own pread)."""
    data = os.urandom(1 << 20)
    f = mac["root"] / "big.dfx"
    f.write_bytes(data)
    r = direct.FileDriveReader("d1", str(mac["root"]))
    errors = []

    def work(i: int) -> None:
        off, n = i * 4099, 65536 + i
        buf = memoryview(bytearray(n))
        if r.read_into(str(f), off, buf) != n or bytes(buf) != data[off : off + n]:
            errors.append(i)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(32)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and len(mac["fcntl"]) == 64


def test_errors_name_the_volume(mac, monkeypatch):
    """A missing file names the drive's /Volumes volume and says to check it is connected; a failed read names the
    volume, the byte count and the offset; F_NOCACHE refused is reported, not ignored."""
    vol = "/Volumes/T7 Shield"
    monkeypatch.setitem(mac["mounts"], vol, {"free": 1 << 40, "fs": "exfat", "dev": "/dev/disk6s1"})
    monkeypatch.setattr(darwin, "_where", lambda path: darwin.Volume(vol, "exfat", "/dev/disk6s1", 0, 0).name)
    r = darwin.DarwinDriveReader("ssd2", str(mac["root"]))
    with pytest.raises(ReadError, match=r"drive ssd2 \(/Volumes/T7 Shield\): cannot open .*is the drive connected"):
        r.read_into(str(mac["root"] / "missing.dfx"), 0, memoryview(bytearray(10)))
    f = mac["root"] / "E.dfx"
    f.write_bytes(b"x" * 100)

    def fail(fd, views, off):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "preadv", fail)
    with pytest.raises(ReadError, match=r"\(/Volumes/T7 Shield\): read of 10 bytes of .* at offset 3 failed: Input"):
        r.read_into(str(f), 3, memoryview(bytearray(10)))
    import fcntl

    def refuse(fd, cmd, arg=0):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(fcntl, "fcntl", refuse)
    with pytest.raises(ReadError, match="F_NOCACHE refused"):
        r.read_into(str(f), 0, memoryview(bytearray(10)))


def test_internal_ssd_named_as_such(mac):
    assert darwin.volume("/Users/me/models").name == "the internal SSD (/)"
    assert darwin.volume(str(mac["root"] / "L0")).mount == str(mac["root"])


def test_free_space_and_mount_point_through_statfs(mac):
    """Free space is statfs's f_bavail x f_bsize of the volume (not the Linux call's), and the mount point is
    statfs's f_mntonname; a folder not made yet counts against the volume it would be made on."""
    root = mac["root"]
    assert drives.free_bytes(str(root / "not" / "yet")) == 3 << 40
    assert drives.mount_point(str(root / "not" / "yet")) == str(root)
    assert str(root) in mac["libc"].calls
    with pytest.raises(DriveError, match="needs 4,398,046,511,104 bytes"):
        drives.check_space({"d1": (str(root), 4 << 40)})
    drives.check_space({"d1": (str(root), 1 << 40)})


def test_a_drive_under_an_unmounted_volume_is_refused_with_its_name(mac, monkeypatch):
    """/Volumes/NAME/... where NAME is not mounted (only the internal disk's /Volumes folder answers statfs): refused
    naming the volume, before anything is made under the internal disk's /Volumes."""
    monkeypatch.setattr(os.path, "isdir", lambda p: False)
    monkeypatch.setattr(os.path, "exists", lambda p: p in ("/", "/Volumes"))
    d = drives.DriveArg("ssd3", "/Volumes/Extreme Pro/k3", None)
    with pytest.raises(DriveError, match=r"drive ssd3: /Volumes/Extreme Pro/k3 is on /Volumes/Extreme Pro, which is "
                                         r"not mounted; connect the drive \(ls /Volumes"):
        drives.require_drives([d], create=True)
    assert darwin.unmounted("/Users/me/k3") == ""


def test_drive_kind_through_diskutil(mac, monkeypatch):
    """diskutil info -plist of the volume: solid state, the bus and internal/external; no answer is 'unknown'."""
    answers = {str(mac["root"]): {"SolidState": True, "BusProtocol": "Thunderbolt", "Internal": False},
               "/": {"SolidState": True, "BusProtocol": "Apple Fabric", "Internal": True}}
    seen = []

    def run(cmd, capture_output, timeout):
        seen.append(cmd)
        info = answers.get(cmd[-1])
        out = plistlib.dumps(info) if info else b""
        return subprocess.CompletedProcess(cmd, 0 if info else 1, out, b"")

    monkeypatch.setattr(subprocess, "run", run)
    assert darwin.drive_kind(str(mac["root"] / "L1")).describe() == "external, Thunderbolt, SSD"
    assert darwin.drive_kind("/Users/me").describe() == "internal, Apple Fabric, SSD"
    assert seen[0] == ["diskutil", "info", "-plist", str(mac["root"])]
    answers.pop("/")
    assert darwin.drive_kind("/Users/me").describe() == "unknown medium"


def test_drive_probe_writes_past_the_cache(mac):
    """The read-rate probe's file is written with F_NOCACHE, so its reads come from the drive, not memory."""
    gbps = drives.probe_read_gbps(str(mac["root"]), "d1", nbytes=8 << 20, depth=2)
    assert gbps > 0
    first = mac["fcntl"][:2]
    assert [(c, a) for _, c, a in first] == [(darwin.F_NOCACHE, 1), (darwin.F_RDAHEAD, 0)]
    assert len(mac["fcntl"]) == 2 + 2 * 2  # the write's descriptor, then one per read (8 MiB in 4 MiB reads)


def test_linux_keeps_its_own_reader(tmp_path):
    assert type(direct.FileDriveReader("d0", str(tmp_path))) is direct.FileDriveReader
    assert not darwin.active() or sys.platform == "darwin"
