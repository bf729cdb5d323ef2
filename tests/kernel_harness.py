"""The CPU kernels of another machine's build, called as the ctypes library is: each call runs once in
``tests/native/kernel_harness.c`` (the kernels compiled into a program) under an emulator, here arm64 NEON builds
under ``qemu-aarch64 -cpu max``. ``HarnessLib`` stands in for ``native.library()``'s object wherever the CPU
backend takes ``lib=``: it reads the buffers a call reads from this process's memory (their sizes by the
function's arguments, ``_BUFFERS``), sends them, and writes the results back where the call writes them, so the
backend's Python code and the x86 tests' float64 references and bounds check the arm64 build unchanged."""

from __future__ import annotations

import ctypes
import shutil
import struct
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "native" / "kernel_harness.c"
CROSS_CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
# the arm64 builds: the baseline (NEON, no dot products), the dot-product extension (SDOT), I8MM (USDOT), and
# df_isa()'s answer for each
ARM_BUILDS = {"neon": (("-march=armv8-a",), 5), "neon-dotprod": (("-march=armv8.2-a+dotprod",), 6),
              "neon-i8mm": (("-march=armv8.6-a+i8mm",), 7)}


def tools_missing() -> str:
    """'' when the cross compiler and the emulator are installed, else what to install."""
    missing = [t for t in (CROSS_CC, QEMU) if shutil.which(t) is None]
    return "" if not missing else (f"{' and '.join(missing)} not installed (Debian: apt-get install "
                                   "gcc-aarch64-linux-gnu qemu-user)")


def build(flags: tuple[str, ...], out: Path) -> Path:
    """The harness with the kernels for an arm64 target (static: the emulator needs no arm64 libraries)."""
    cmd = [CROSS_CC, "-O3", "-static", "-fopenmp", *flags, str(HARNESS), "-o", str(out), "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}: {r.stderr[-2000:]}"
    return out


def _ssz(kind: int) -> int:
    return {0: 1, 1: 2, 2: 4}[kind]  # bytes per scale: E8M0, bf16, float32


# per function: (argument index, bytes, output?) for each pointer argument, from the call's arguments a
_BUFFERS = {
    "df_q4q8_mm": lambda a: [(1, a[9] * a[10] // 2, 0), (2, a[9] * a[10] // 32 * _ssz(a[0]), 0), (3, 16, 0),
                             (6, 1024, 0), (7, a[11] * a[10] * 4, 0), (8, a[11] * a[9] * 4, 1)],
    "df_q4_mm": lambda a: [(1, a[8] * a[9] // 2, 0), (2, a[8] * a[9] // 32 * _ssz(a[0]), 0), (3, 64, 0),
                           (4, 1024, 0), (5, a[10] * a[9] * 2, 0), (6, a[10] * a[9] * 2, 0),
                           (7, a[10] * a[8] * 4, 1)],
    "df_q4_decode": lambda a: [(1, (a[6] + a[7]) * a[8] // 2, 0),
                               (2, (a[6] + a[7]) * a[8] // 32 * _ssz(a[0]), 0), (3, 64, 0), (4, 1024, 0),
                               (5, a[7] * a[8] * 4, 1)],
    "df_i8_mm": lambda a: [(0, a[4] * a[5], 0), (1, a[4] * 4, 0), (2, a[6] * a[5] * 4, 0), (3, a[6] * a[4] * 4, 1)],
    "df_glu_act": lambda a: [(3, a[6] * 4, 0), (4, a[6] * 4, 0), (5, a[6] * 4, 1)],
    "df_q4q8_glu": lambda a: [(4, a[16] * a[17] // 2, 0), (5, a[16] * a[17] // 32 * _ssz(a[3]), 0),
                              (6, a[16] * a[17] // 2, 0), (7, a[16] * a[17] // 32 * _ssz(a[3]), 0),
                              (8, a[16] * a[17] // 2, 0), (9, a[16] * a[17] // 32 * _ssz(a[3]), 0), (10, 16, 0),
                              (13, 1024, 0), (14, a[18] * a[17] * 4, 0), (15, a[18] * a[17] * 4, 1)],
}
_BUFFERS["df_i8a16_mm"] = _BUFFERS["df_i8_mm"]
_BUFFERS["df_q4gw_mm"] = _BUFFERS["df_q4q8_mm"]
_BUFFERS["df_i8gw_mm"] = _BUFFERS["df_i8_mm"]
_FLOATS = {"df_q4q8_mm": {5}, "df_q4gw_mm": {5}, "df_glu_act": {1, 2}, "df_q4q8_glu": {1, 2, 12}}
QUERIES = ("df_isa", "df_simd_width", "df_q8_vnni", "df_a16_vnni", "df_q4gw_vnni", "df_q8_terms", "df_openmp",
           "ftz_check")


class HarnessLib:
    """``native.library()``'s interface over one harness binary (the functions in ``_BUFFERS`` and ``QUERIES``;
    the others, which take arrays of pointers, raise AttributeError). ``calls`` counts the calls run."""

    def __init__(self, binary: Path, cpu: str = "max"):
        self.binary, self.cpu, self.calls = binary, cpu, 0
        self._cache: dict[str, float] = {}

    def __getattr__(self, name: str):
        if name in QUERIES:
            return lambda: int(self._cache.setdefault(name, self.run(name, [])))
        if name not in _BUFFERS:
            raise AttributeError(name)
        return lambda *args: self.call(name, args)

    def call(self, name: str, args: tuple) -> float:
        a = [0 if v is None else v.value if isinstance(v, ctypes._SimpleCData) else v for v in args]
        bufs = {i: (n, out) for i, n, out in _BUFFERS[name](a)}
        parts = []
        for i, v in enumerate(a):
            if i in bufs and args[i] is None:
                parts.append(b"n")
            elif i in bufs:
                n, out = bufs[i]
                parts.append(b"o" + struct.pack("<q", n) if out else b"b" + struct.pack("<q", n) +
                             ctypes.string_at(v, n))
            elif i in _FLOATS.get(name, ()):
                parts.append(b"f" + struct.pack("<d", float(v)))
            else:
                parts.append(b"i" + struct.pack("<q", int(v)))
        reply = self._exchange(name, parts)
        at = 8
        for i in sorted(bufs):
            n, out = bufs[i]
            if out and args[i] is not None:
                ctypes.memmove(a[i], reply[at : at + n], n)
                at += n
        return struct.unpack("<d", reply[:8])[0]

    def run(self, name: str, parts: list[bytes]) -> float:
        return struct.unpack("<d", self._exchange(name, parts)[:8])[0]

    def _exchange(self, name: str, parts: list[bytes]) -> bytes:
        req = name.encode().ljust(32, b"\0") + struct.pack("<i", len(parts)) + b"".join(parts)
        r = subprocess.run([QEMU, "-cpu", self.cpu, str(self.binary)], input=req, capture_output=True, timeout=300)
        self.calls += 1
        assert r.returncode == 0, f"{name} under {QEMU}: exit {r.returncode} {r.stderr[-500:]!r}"
        return r.stdout
