"""The compiled CPU kernels (``cpu_kernels.c``): built once per machine with the system C compiler, loaded
with ctypes.

The library is compiled for this CPU (``-march=native``, AVX-512 where present; ``-mcpu=native`` with a compiler
that refuses that, as clang before 15 does on arm64, then the compiler's default target) on first use, about a second,
and kept under ``$DELTAFIN_CACHE`` (default ``~/.cache/deltafin``) keyed by the source, the compiler and the
CPU, so later processes load it at once. Without a C compiler the fast CPU path is off and the plain torch path
runs (one warning says what to install). ``DELTAFIN_CPU_KERNELS=0`` turns the fast CPU path off.

On arm64 (Apple M-series, Graviton, Ampere, Grace) the same source builds NEON code, with the dot-product
extension's SDOT and I8MM's USDOT where the compiler's native target has them (``df_isa()`` says which).

``DELTAFIN_CPU_ISA`` builds for less than this CPU has, to measure what other machines run. x86: ``avx2`` (no
AVX-512: AVX2, with AVX-VNNI where this CPU has it), ``avx2-novnni`` (AVX2 alone) or ``portable`` (no AVX2: the
plain C loops). arm64: ``neon`` (Armv8.0, no dot products), ``neon-dotprod`` (SDOT) or ``neon-i8mm`` (USDOT).
Unset or ``native``, everything this CPU has.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-shared", "-fPIC")
# this CPU's instruction set, first choice first: clang before 15 on arm64 (Apple's among them) refuses
# -march=native and takes -mcpu=native; a compiler that takes neither builds for its default target (the plain C
# loops on x86, NEON's baseline on arm64)
ARCH_FLAGS = (("-march=native",), ("-mcpu=native",), ())
INSTALL_HINT = ("install a C compiler for the fast CPU kernels (Debian/Ubuntu: apt install gcc; Fedora: dnf "
                "install gcc; macOS: xcode-select --install), or set CC")

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "df_q4_mm": [_INT, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _INT],
    "df_q4_decode": [_INT, _P, _P, _P, _P, _P, _I64, _I64, _I64, _INT],
    "df_i8_mm": [_P, _P, _P, _P, _I64, _I64, _I64, _INT],
    "df_q4q8_mm": [_INT, _P, _P, _P, _INT, ctypes.c_float, _P, _P, _P, _I64, _I64, _I64, _INT],
    "df_i8a16_mm": [_P, _P, _P, _P, _I64, _I64, _I64, _INT],
    "df_q4q8_glu": [_INT, _F, _F, _INT, _P, _P, _P, _P, _P, _P, _P, _INT, _F, _P, _P, _P, _I64, _I64, _I64, _INT],
    "df_q4q8_glu_many": [_INT, _INT, _F, _F, _INT, _P, _P, _P, _P, _P, _P, _P, _INT, _F, _P, _P, _P, _P, _I64, _I64,
                         _INT],
    "df_q4gw_glu": [_INT, _F, _F, _INT, _P, _P, _P, _P, _P, _P, _P, _INT, _F, _P, _P, _P, _P, _I64, _I64, _I64,
                    _INT],
    "df_glu_act": [_INT, _F, _F, _P, _P, _P, _I64],
    "df_a16_vnni": [],
    "df_i8a16_multi": [_INT, _P, _P, _P, _P, _P, _I64, _I64, _INT],
    "df_i8a16_heads": [_INT, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _INT],
    "df_q8_vnni": [],
    "df_simd_width": [],
    "df_isa": [],
    "df_q8_terms": [],
    "df_one_row_loops": [],
    "df_ftz": [_INT, _INT],
    "df_i8gw_mm": [_P, _P, _P, _P, _I64, _I64, _I64, _INT],
    "df_q4gw_mm": [_INT, _P, _P, _P, _INT, ctypes.c_float, _P, _P, _P, _I64, _I64, _I64, _INT],
    "df_q4gw_vnni": [],
    "df_gw_u8": [],
    "df_gw_peak": [_INT, _I64],
    "df_gw_merge": [_INT, _P, _I64, _I64, _I64, _I64, _I64],
    "df_openmp": [],
    "df_attend_rows": [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F, _INT],
    "df_rms_rows": [_P, _P, _P, _I64, _I64, _F],
    "df_rope1": [_P, _P, _P, _I64, _I64, _I64],
    "df_gqa1": [_P, _P, _P, _F, _F, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _INT, _INT, _INT],
    "df_gqa_table_size": [],
    "df_route1": [_P, _P, _F, _P, _I64, _I64, _I64, _INT, _P, _P, _P, _INT],
    "df_moe_sum1": [_P, _P, _P, _I64, _I64, _P],
}
_lock = threading.Lock()
_loaded: dict[tuple[str, ...], ctypes.CDLL | None] = {}
_why: dict[tuple[str, ...], str] = {}


def _cpu_id() -> str:
    """What -march=native depends on: the machine and, on Linux, the CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|{flags}"


def tuning_flags() -> tuple[str, ...]:
    """Choices of the code by CPU maker, measured: on AMD (Zen 5) the GEMM's token pair broadcast into a register
    and then multiplied ran 5-10% faster than vpdpwssd's broadcast from memory, which Intel (Emerald Rapids) runs
    5-9% faster; the build's default is Intel's. On AMD (Zen 3) the one-token loops prefetch their weight streams
    non-temporally: a warm decode step 2-7% faster, the host work between kernels no longer finding its code and data
    evicted from L3 by ~400 MB of weights a token (docs/KERNELS.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("vendor_id")), "")
    except OSError:
        vendor = ""
    return ("-DGW_EMB=0", "-DDF_STREAM_HINT=_MM_HINT_NTA") if vendor == "AuthenticAMD" else ()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    return cc if cc and shutil.which(cc) else None


def _compile(cc: str, extra: tuple[str, ...], out: Path, text: str) -> str | None:
    """Build ``text`` (the source whose hash names ``out``, written to a temp file beside it: a source file changed
    after it was hashed cannot end up cached under the old text's name) into a temp name beside ``out`` and rename
    (a concurrent build never leaves a half-written library).
    This CPU's instruction set by the first of ``ARCH_FLAGS`` the compiler takes; OpenMP first, then without it
    (one thread, e.g. Apple clang without libomp). Returns the first attempt's error when none built, else None;
    a build past the first arch flags is logged with what the compiler said of them."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, src = tempfile.mkstemp(prefix="cpu_kernels-", suffix=".c", dir=out.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    try:
        return _compile_source(cc, extra, out, src)
    finally:
        os.unlink(src)


def _compile_source(cc: str, extra: tuple[str, ...], out: Path, src: str) -> str | None:
    first = ""
    for arch in ARCH_FLAGS:
        for omp in (("-fopenmp",), ()):
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
            os.close(fd)
            cmd = [cc, *FLAGS, *arch, *omp, *tuning_flags(), *extra, src, "-o", tmp]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode == 0:
                os.replace(tmp, out)
                if arch != ARCH_FLAGS[0]:
                    log.warning("CPU kernels built with %s: %s", " ".join(arch) or "the compiler's default target",
                                first)
                return None
            with contextlib.suppress(FileNotFoundError):  # a failed link removes its own output (clang does)
                os.unlink(tmp)
            err = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["failed"]
            first = first or f"{' '.join(cmd)}: {err[0]}"
    return first


ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",), "avx2-novnni": ("-mno-avx512f", "-mno-avxvnni"),
             "portable": ("-mno-avx512f", "-mno-avx2")}
# arm64's, by target (the last -march given wins over -march=native)
ARM_ISA_FLAGS = {"native": (), "neon": ("-march=armv8-a",), "neon-dotprod": ("-march=armv8.2-a+dotprod",),
                 "neon-i8mm": ("-march=armv8.6-a+i8mm",)}
ISA_NAMES = {4: "avx512", 3: "avx2+avx-vnni", 2: "avx2", 7: "neon+i8mm", 6: "neon+dotprod", 5: "neon",
             0: "plain C"}  # df_isa()


_ISA_SEEN: dict[str, tuple[str, ...]] = {}  # DELTAFIN_CPU_ISA's value -> its flags (library() runs per matmul)


def isa_flags() -> tuple[str, ...]:
    """The compiler flags ``DELTAFIN_CPU_ISA`` asks for (none when unset or ``native``; the others are x86's)."""
    raw = os.environ.get("DELTAFIN_CPU_ISA", "")
    flags = _ISA_SEEN.get(raw)
    if flags is None:
        flags = _ISA_SEEN[raw] = _isa_flags(raw)
    return flags


def _isa_flags(raw: str) -> tuple[str, ...]:
    from deltafin.errors import UsageError

    name = raw.strip().lower() or "native"
    arm = platform.machine() in ("arm64", "aarch64")
    here, other = (ARM_ISA_FLAGS, ISA_FLAGS) if arm else (ISA_FLAGS, ARM_ISA_FLAGS)
    if name in here:
        return here[name]
    if name in other:
        raise UsageError(f"DELTAFIN_CPU_ISA={name}: an {'x86' if arm else 'arm64'} build, and this machine is "
                         f"{platform.machine()}; use one of {', '.join(here)} or unset DELTAFIN_CPU_ISA")
    raise UsageError(f"DELTAFIN_CPU_ISA={name!r}: not a build this knows; use one of {', '.join(here)}")


def library(extra: tuple[str, ...] | None = None) -> ctypes.CDLL | None:
    """The kernels built with ``extra`` compiler flags (default: ``isa_flags()``; tests build the builds of
    machines without AVX-512 with ``ISA_FLAGS``), or None when they cannot be built here (``why()`` says why)."""
    if extra is None:
        extra = isa_flags()
    with _lock:
        if extra in _loaded:
            return _loaded[extra]
        lib, why = None, ""
        if os.environ.get("DELTAFIN_CPU_KERNELS", "1") == "0":
            why = "DELTAFIN_CPU_KERNELS=0"
        elif (cc := _compiler()) is None:
            why = f"no C compiler found; {INSTALL_HINT}"
        else:
            ver = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
            text = SOURCE.read_text()
            key = hashlib.sha256("\0".join([text, cc, ver, _cpu_id(), *FLAGS, *sum(ARCH_FLAGS, ()), *tuning_flags(),
                                            *extra]).encode())
            cache = Path(os.environ.get("DELTAFIN_CACHE", Path.home() / ".cache" / "deltafin")) / "kernels"
            path = cache / f"cpu_kernels-{key.hexdigest()[:16]}.so"
            try:
                err = None if path.exists() else _compile(cc, extra, path, text)
            except OSError as e:  # e.g. a read-only home: point DELTAFIN_CACHE somewhere writable
                err = f"cannot write {path.parent}: {e.strerror}; set DELTAFIN_CACHE to a writable folder"
            if err:
                why = f"building the CPU kernels failed ({err}); {INSTALL_HINT}"
            else:
                lib = ctypes.CDLL(str(path))
                for name, args in _SIGNATURES.items():
                    getattr(lib, name).argtypes = args
                lib.df_q4gw_mm.restype = lib.df_q4gw_vnni.restype = lib.df_i8gw_mm.restype = lib.df_gw_u8.restype = _INT
                lib.df_gw_peak.restype = ctypes.c_double
                lib.df_simd_width.restype = lib.df_isa.restype = lib.df_one_row_loops.restype = lib.df_q8_terms.restype = lib.df_ftz.restype = lib.df_q8_vnni.restype = lib.df_q4q8_mm.restype = _INT
                lib.df_i8a16_mm.restype = lib.df_a16_vnni.restype = lib.df_q4q8_glu.restype = lib.df_gw_merge.restype = _INT
                lib.df_i8a16_multi.restype = lib.df_i8a16_heads.restype = lib.df_q4gw_glu.restype = lib.df_q4q8_glu_many.restype = _INT
                lib.df_glu_act.restype = lib.df_rms_rows.restype = lib.df_rope1.restype = None
                lib.df_openmp.restype = lib.df_attend_rows.restype = _INT
                if not lib.df_openmp():
                    log.warning("CPU kernels built without OpenMP: they run on one thread; install OpenMP for %s "
                                "(Debian/Ubuntu: apt install libomp-dev for clang; macOS: brew install libomp)", cc)
        if lib is None:
            log.warning("fast CPU kernels off, the plain torch path runs: %s", why)
        _loaded[extra], _why[extra] = lib, why
        return lib


def why(extra: tuple[str, ...] | None = None) -> str:
    """Why ``library(extra)`` is None ('' when it loaded or was not tried)."""
    return _why.get(isa_flags() if extra is None else extra, "")
