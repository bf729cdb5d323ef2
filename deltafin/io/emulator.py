"""An emulated drive set: real bytes at modelled speeds, behind the ``DriveReader`` interface.

Each emulated drive serves the bytes of real files (buffered reads) or of in-memory buffers, and
makes every read take the time its ``DriveModel`` says. The same model (``DriveTimeline``) drives
the discrete-event simulator in ``deltafin.sim``, so the two agree by construction.

Timing model of one drive (all reads of a drive share it):
  * a read waits for one of ``qd`` device slots (0 = unlimited), then pays its latency: ``lat``
    times a lognormal factor with sigma ``jitter`` and mean 1;
  * its transfer then occupies the drive's bus, in arrival order, for ``bytes / rate`` seconds
    (at least ``1 / iops`` when an IOPS cap is set): concurrent reads share the rate, which is a
    hard ceiling (jitter never makes a drive faster than its rate);
  * with probability ``p`` a read is slow: its own completion is delayed by ``(x - 1)`` times its
    latency plus transfer (the bus is not held longer: one slow read does not stall the others).
  So a drive reaches its rate only with enough reads in flight: with reads of ``s`` bytes the
  saturation depth is about ``1 + lat * rate / s`` (see ``DriveModel.rate_at``).

Spec grammar (``--emulate-drives SPEC``, ``parse_spec``)::

    SPEC    := SET [ "@" SCALE ]
    SET     := PRESET | DRIVE ( ";" DRIVE )*
    DRIVE   := LABEL ":" RATE ( "," OPTION )*
    RATE    := NUMBER ( "GBps" | "GB/s" | "MBps" | "MB/s" )       6.0GBps, 800MBps
    OPTION  := "lat=" NUMBER ( "ns" | "us" | "ms" | "s" )          mean per-read latency (default 80us)
             | "jitter=" NUMBER                                   lognormal sigma of latency (default 0)
             | "slow=" PROB "x" NUMBER                            slow-read chance and multiplier: slow=0.01x8
             | "qd=" INT                                          device slots, 0 = unlimited (default 0)
             | "iops=" NUMBER [ "k" | "M" ]                       cap on reads per second (default none)
             | "fail=" PROB                                       fraction of reads failing (emulated EIO)
             | "failpath=" TEXT                                   reads of paths containing TEXT fail
    SCALE   := NUMBER                                             multiplies every RATE and iops cap

``PRESET`` names a set from ``PRESETS``: ``report4`` is shaped like the original report's machine
(internal 7 GB/s, three Thunderbolt 5 enclosures at 6 GB/s: ~25 GB/s summed); ``report4@0.04``
scales it to ~1 GB/s for a small machine. Latencies are never scaled.

Calibration against the real disk (``calibrate``, ``measure_reader``) lives in ``deltafin.io.calibrate``.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import random
import re
import statistics
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from deltafin.errors import ReadError, UsageError
from deltafin.io.direct import ALIGN, aligned_buffer
from deltafin.store.placement import DriveSpec

log = logging.getLogger(__name__)

PRESETS: dict[str, str] = {
    "report4": (
        "internal:7GBps,lat=70us,jitter=0.1;"
        "tb1:6GBps,lat=120us,jitter=0.2,slow=0.001x4;"
        "tb2:6GBps,lat=120us,jitter=0.2,slow=0.001x4;"
        "tb3:6GBps,lat=120us,jitter=0.2,slow=0.001x4"
    ),
    "internal": "internal:7GBps,lat=70us,jitter=0.1",
}

_LABEL_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True, slots=True)
class DriveModel:
    """Speed, latency, queueing, tail and failure behaviour of one (emulated or simulated) drive."""

    label: str
    gbps: float  # read rate, GB/s (1e9 bytes/s)
    lat_us: float = 80.0  # mean per-read latency
    jitter: float = 0.0  # lognormal sigma of the latency (mean-preserving)
    slow_p: float = 0.0  # probability that a read is slow
    slow_x: float = 1.0  # time multiplier of a slow read
    qd: int = 0  # device slots (reads served at once); 0 = unlimited
    iops: float = 0.0  # cap on reads per second; 0 = none
    fail_p: float = 0.0  # fraction of reads failing with an emulated I/O error
    fail_paths: tuple[str, ...] = ()  # reads of paths containing one of these fail

    def __post_init__(self) -> None:
        if not _LABEL_RE.match(self.label):
            raise ValueError(f"drive label {self.label!r}: use letters, digits, '_', '-', '.'")
        if not (self.gbps > 0 and math.isfinite(self.gbps)):
            raise ValueError(f"drive {self.label}: read rate must be > 0 GB/s, got {self.gbps}")
        checks = [
            (self.lat_us >= 0, f"latency must be >= 0 us, got {self.lat_us}"),
            (self.jitter >= 0, f"jitter (lognormal sigma) must be >= 0, got {self.jitter}"),
            (0 <= self.slow_p < 1, f"slow-read probability must be in [0, 1), got {self.slow_p}"),
            (self.slow_x >= 1, f"slow-read multiplier must be >= 1, got {self.slow_x}"),
            (self.qd >= 0, f"qd must be >= 0 (0 = unlimited), got {self.qd}"),
            (self.iops >= 0, f"iops must be >= 0 (0 = no cap), got {self.iops}"),
            (0 <= self.fail_p <= 1, f"failure fraction must be in [0, 1], got {self.fail_p}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"drive {self.label}: {msg}")

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9

    def service_s(self, nbytes: int) -> float:
        """Seconds the drive's bus is busy transferring one read of ``nbytes``."""
        t = nbytes / self.bytes_per_s
        return max(t, 1.0 / self.iops) if self.iops else t

    def rate_at(self, depth: int, nbytes: int) -> float:
        """Steady-state GB/s with ``depth`` reads of ``nbytes`` always in flight (mean latency)."""
        svc = self.service_s(nbytes)
        slots = min(depth, self.qd) if self.qd else depth
        per_read = self.lat_us * 1e-6 + svc
        return min(nbytes / svc, slots * nbytes / per_read) / 1e9

    def saturation_depth(self, nbytes: int) -> int:
        """Reads of ``nbytes`` that must be in flight for the drive to reach its rate."""
        svc = self.service_s(nbytes)
        return math.ceil((self.lat_us * 1e-6 + svc) / svc)

    def scaled(self, scale: float) -> DriveModel:
        """The same drive with rate and IOPS cap multiplied by ``scale`` (latency unchanged)."""
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        return replace(self, gbps=self.gbps * scale, iops=self.iops * scale)

    def spec(self) -> str:
        """This drive in the ``--emulate-drives`` grammar."""
        parts = [f"{self.label}:{self.gbps:.6g}GBps", f"lat={self.lat_us:.6g}us"]
        if self.jitter:
            parts.append(f"jitter={self.jitter:.6g}")
        if self.slow_p:
            parts.append(f"slow={self.slow_p:.6g}x{self.slow_x:.6g}")
        if self.qd:
            parts.append(f"qd={self.qd}")
        if self.iops:
            parts.append(f"iops={self.iops:.6g}")
        if self.fail_p:
            parts.append(f"fail={self.fail_p:.6g}")
        parts += [f"failpath={p}" for p in self.fail_paths]
        return ",".join(parts)

    def to_drive_spec(self) -> DriveSpec:
        return DriveSpec(self.label, self.gbps)


class DriveTimeline:
    """Virtual-time service model of one drive. Not thread-safe: callers serialise ``reserve``.

    Times are seconds on any clock the caller uses consistently (``time.monotonic`` in the
    emulator, simulated time in ``deltafin.sim``).
    """

    def __init__(self, model: DriveModel, seed: int = 0):
        self.model = model
        self.bus_free = 0.0
        self._slots: list[float] = []  # end times of reads holding a device slot
        self._rng = random.Random(seed)
        self._np = None  # numpy generator for reserve_batch, made on first use

    def sample_jitter(self) -> float:
        s = self.model.jitter
        # mean-preserving lognormal: E[exp(sZ - s^2/2)] = 1
        return math.exp(s * self._rng.gauss(0.0, 1.0) - s * s / 2) if s else 1.0

    def reserve(self, now: float, nbytes: int) -> float:
        """Book a read of ``nbytes`` arriving at ``now``; return the time it completes."""
        m = self.model
        start = now
        if m.qd:
            while self._slots and self._slots[0] <= now:
                heapq.heappop(self._slots)
            if len(self._slots) >= m.qd:
                start = max(now, heapq.heappop(self._slots))
        lat = m.lat_us * 1e-6 * self.sample_jitter()
        svc = m.service_s(nbytes)
        end = max(start + lat, self.bus_free) + svc
        self.bus_free = end
        if m.slow_p and self._rng.random() < m.slow_p:
            end += (m.slow_x - 1.0) * (lat + svc)
        if m.qd:
            heapq.heappush(self._slots, end)
        return end

    def reserve_batch(self, now: float, sizes: Sequence[int]) -> float:
        """Book reads of ``sizes`` all arriving at ``now``, in order; return when the last completes.

        The same model as ``reserve`` (own random stream), vectorised for the simulator: with
        unlimited slots the bus recurrence end_i = max(now + lat_i, end_(i-1)) + svc_i has the
        closed form end_i = S_i + max(bus_free, max_(j<=i)(now + lat_j - S_(j-1))), S = cumsum(svc).
        """
        m = self.model
        if m.qd or len(sizes) < 8:
            return max((self.reserve(now, n) for n in sizes), default=now)
        import numpy as np

        if self._np is None:
            self._np = np.random.default_rng(self._rng.getrandbits(63))
        n = np.asarray(sizes, dtype=np.float64)
        svc = n / m.bytes_per_s
        if m.iops:
            svc = np.maximum(svc, 1.0 / m.iops)
        f = np.exp(m.jitter * self._np.standard_normal(len(n)) - m.jitter**2 / 2) if m.jitter else np.ones(len(n))
        lat = m.lat_us * 1e-6 * f
        S = np.cumsum(svc)
        start = np.maximum.accumulate(now + lat - (S - svc))
        end = S + np.maximum(self.bus_free, start)
        self.bus_free = float(end[-1])
        if m.slow_p:
            slow = self._np.random(len(n)) < m.slow_p
            end = end + slow * (m.slow_x - 1.0) * (lat + svc)
        return float(end.max())

    def backlog_bytes(self, now: float) -> float:
        """Bytes still queued on the bus at ``now`` (what a scheduler sees as the drive's queue)."""
        return max(0.0, self.bus_free - now) * self.model.bytes_per_s


# ---------------------------------------------------------------- spec parsing


def _bad(part: str, expected: str) -> UsageError:
    return UsageError(f"--emulate-drives: cannot read {part!r}; expected {expected}")


_DRIVE_FORM = "LABEL:RATE[,OPTION...] such as 'ext1:2.5GBps,lat=120us,jitter=0.2' (see deltafin.io.emulator)"


def _number(text: str, part: str, expected: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise _bad(part, expected) from None
    if not math.isfinite(v):
        raise _bad(part, expected)
    return v


def _parse_rate(text: str) -> float:
    m = re.fullmatch(r"([0-9.eE+-]+)\s*(GBps|GB/s|MBps|MB/s)", text.strip(), re.IGNORECASE)
    expected = "a rate such as 6.0GBps or 800MBps"
    if not m:
        raise _bad(text, expected)
    v = _number(m.group(1), text, expected)
    return v / 1000.0 if m.group(2).upper().startswith("M") else v


def _parse_duration_us(text: str, part: str) -> float:
    m = re.fullmatch(r"([0-9.eE+-]+)\s*(ns|us|ms|s)", text.strip())
    expected = "a latency such as lat=80us or lat=0.2ms"
    if not m:
        raise _bad(part, expected)
    mult = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[m.group(2)]
    return _number(m.group(1), part, expected) * mult


def _parse_option(key: str, val: str, part: str, fields: dict) -> None:
    if key == "lat":
        fields["lat_us"] = _parse_duration_us(val, part)
    elif key == "jitter":
        fields["jitter"] = _number(val, part, "jitter=SIGMA such as jitter=0.2")
    elif key == "slow":
        p, sep, x = val.partition("x")
        if not sep:
            raise _bad(part, "slow=PROBxMULT such as slow=0.01x8")
        fields["slow_p"] = _number(p, part, "slow=PROBxMULT such as slow=0.01x8")
        fields["slow_x"] = _number(x, part, "slow=PROBxMULT such as slow=0.01x8")
    elif key == "qd":
        if not val.isdigit():
            raise _bad(part, "qd=INT such as qd=32 (0 = unlimited)")
        fields["qd"] = int(val)
    elif key == "iops":
        mult = {"k": 1e3, "K": 1e3, "M": 1e6}.get(val[-1:], 1.0)
        num = val[:-1] if mult != 1.0 else val
        fields["iops"] = _number(num, part, "iops=NUMBER such as iops=500k") * mult
    elif key == "fail":
        fields["fail_p"] = _number(val, part, "fail=FRACTION such as fail=0.01")
    elif key == "failpath":
        if not val:
            raise _bad(part, "failpath=TEXT (reads of paths containing TEXT fail)")
        fields["fail_paths"] = fields.get("fail_paths", ()) + (val,)
    else:
        raise _bad(part, "an option among lat=, jitter=, slow=, qd=, iops=, fail=, failpath=")


def _parse_drive(text: str) -> DriveModel:
    label, sep, rest = text.partition(":")
    if not sep or not label.strip() or not rest.strip():
        raise _bad(text, _DRIVE_FORM)
    items = rest.split(",")
    fields: dict = {"gbps": _parse_rate(items[0])}
    for item in items[1:]:
        key, eq, val = item.strip().partition("=")
        if not eq:
            raise _bad(item, "OPTION=VALUE such as lat=80us")
        _parse_option(key.strip(), val.strip(), item.strip(), fields)
    try:
        return DriveModel(label=label.strip(), **fields)
    except ValueError as e:
        raise UsageError(f"--emulate-drives: {text!r}: {e}") from None


def parse_spec(spec: str, scale: float | None = None) -> tuple[DriveModel, ...]:
    """Parse an ``--emulate-drives`` spec (grammar in the module docstring) into drive models.

    ``scale`` multiplies every rate (after any ``@SCALE`` in the spec). Raises ``UsageError``
    naming the part it could not read and the form it expected.
    """
    body, at, factor = spec.strip().partition("@")
    total = 1.0
    if at:
        total = _number(factor.strip(), "@" + factor, "@SCALE such as report4@0.04")
        if total <= 0:
            raise _bad("@" + factor, "a scale > 0 such as @0.04")
    if scale is not None:
        if not scale > 0:
            raise UsageError(f"--emulate-drives: scale must be > 0, got {scale}")
        total *= scale
    body = PRESETS.get(body.strip(), body)
    parts = [p.strip() for p in body.split(";") if p.strip()]
    if not parts:
        raise _bad(spec, f"a preset ({', '.join(PRESETS)}) or {_DRIVE_FORM}")
    models = tuple(_parse_drive(p) for p in parts)
    labels = [m.label for m in models]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise UsageError(f"--emulate-drives: drive label {dup[0]!r} appears twice; give each drive its own label")
    return tuple(m.scaled(total) for m in models) if total != 1.0 else models


def format_spec(models: Sequence[DriveModel]) -> str:
    """The inverse of ``parse_spec`` (without scale)."""
    return ";".join(m.spec() for m in models)


# ---------------------------------------------------------------- emulated reads


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
_PR_SET_TIMERSLACK = 29


def _tighten_timer_slack() -> None:
    """Linux: cut this thread's timer slack from 50 us to 1 us, so short sleeps end on time."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class _Clock:
    """Sleeps until monotonic deadlines, learning the OS sleep overshoot so deadlines are kept.

    time.sleep overshoots by tens of microseconds (more under Linux's default 50 us timer slack,
    which we lower per thread); we sleep short of the deadline by the learned overshoot (mean + 3
    deviations) and yield the CPU for the last microseconds.
    """

    _MAX_GUARD = 300e-6  # never wake earlier than this before a deadline, whatever was learned

    def __init__(self) -> None:
        self._over = 100e-6  # running mean of the overshoot
        self._dev = 30e-6  # running mean absolute deviation
        self._lock = threading.Lock()
        self._local = threading.local()
        self.overhead = 0.0  # seconds a read spends in Python around its timed window

    def now(self) -> float:
        return time.monotonic()

    def sleep_until(self, deadline: float) -> float:
        """Return how late (seconds, >= 0) the caller wakes after ``deadline``."""
        if not getattr(self._local, "tight", False) and sys.platform.startswith("linux"):
            _tighten_timer_slack()
            self._local.tight = True
        while True:
            now = time.monotonic()
            rem = deadline - now
            if rem <= 0:
                return -rem
            want = rem - min(self._over + 3 * self._dev, self._MAX_GUARD)
            if want > 0:
                time.sleep(want)
                self._learn(time.monotonic() - now - want)
            elif rem > 50e-6:
                time.sleep(0)  # ~20 us with tight slack: sleeping, not spinning, when CPUs are shared
            else:
                _yield()  # releases the GIL while we wait out the last microseconds

    def _learn(self, over: float) -> None:
        with self._lock:
            self._dev = 0.95 * self._dev + 0.05 * abs(over - self._over)
            self._over = 0.95 * self._over + 0.05 * max(0.0, over)


def _copy_nogil(dst: memoryview, src, offset: int, n: int) -> None:
    """dst[:n] = src[offset:offset + n]; large copies go through ctypes.memmove, which releases the
    GIL, so concurrent emulated reads do not queue behind each other's copies."""
    if n < (64 << 10) or dst.readonly or not isinstance(src, bytes):
        dst[:n] = memoryview(src)[offset : offset + n]
        return
    import ctypes

    base = ctypes.cast(ctypes.c_char_p(src), ctypes.c_void_p).value
    target = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    ctypes.memmove(target, base + offset, n)


class EmulatedDriveReader:
    """One emulated drive: serves real bytes, timed by its ``DriveModel``. Thread-safe."""

    direct = True  # models a direct-I/O drive: no page-cache speedup on repeated reads

    def __init__(self, model: DriveModel, clock: _Clock, memory: Mapping[str, bytes] | None = None,
                 seed: int = 0):
        self.model = model
        self._clock = clock
        self._memory = memory
        self._timeline = DriveTimeline(model, seed)
        self._fail_rng = random.Random(seed ^ 0x5EED)
        self._lock = threading.Lock()
        self.reads = 0
        self.bytes = 0
        self.failures = 0
        self.late_s = 0.0  # total time reads finished after their modelled completion

    @property
    def label(self) -> str:
        return self.model.label

    def set_failures(self, fraction: float | None = None, paths: Sequence[str] | None = None) -> None:
        """Change failure injection at run time (fraction of reads, and/or path substrings)."""
        fields = {}
        if fraction is not None:
            fields["fail_p"] = fraction
        if paths is not None:
            fields["fail_paths"] = tuple(paths)
        with self._lock:
            self.model = replace(self.model, **fields)
            self._timeline.model = self.model

    def _should_fail(self, path: str) -> str | None:
        m = self.model
        for sub in m.fail_paths:
            if sub in path:
                return f"failpath={sub}"
        if m.fail_p and self._fail_rng.random() < m.fail_p:
            return f"fail={m.fail_p:g}"
        return None

    def _copy(self, path: str, offset: int, buf: memoryview) -> int:
        if self._memory is not None and path in self._memory:
            src = self._memory[path]
            n = max(0, min(len(buf), len(src) - offset))
            _copy_nogil(buf, src, offset, n)
            return n
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise ReadError(f"drive {self.label}: cannot open {path}: {e.strerror}") from e
        try:
            total = 0
            while total < len(buf):
                got = os.preadv(fd, [buf[total:]], offset + total)
                if got == 0:
                    break
                total += got
            return total
        except OSError as e:
            raise ReadError(f"drive {self.label}: read of {path} at offset {offset} failed: {e.strerror}") from e
        finally:
            os.close(fd)

    def read_into(self, path: str, offset: int, buf: memoryview) -> int:
        """Fill ``buf`` from ``path`` at ``offset``, taking the modelled time; return bytes read."""
        t0 = self._clock.now()
        with self._lock:
            why = self._should_fail(path)
        got = 0 if why else self._copy(path, offset, buf)
        with self._lock:
            end = self._timeline.reserve(t0, got if got else len(buf))
        late = self._clock.sleep_until(end - self._clock.overhead)
        with self._lock:
            self.reads += 1
            self.bytes += got
            self.late_s += late
            self.failures += bool(why)
        if why:
            raise ReadError(f"drive {self.label}: read of {path} at offset {offset} failed: emulated I/O error "
                            f"({why}); read a replica on another drive, or drop '{why}' from --emulate-drives")
        return got

    def stats(self) -> dict:
        with self._lock:
            return {"label": self.label, "reads": self.reads, "bytes": self.bytes,
                    "failures": self.failures, "late_s": self.late_s}


def _measure_overhead(clock: _Clock, calls: int = 200) -> float:
    """Median wall time of one emulated read that models zero time: what a caller sees on top of
    the model, subtracted from every deadline so measured latencies match the model."""
    probe = EmulatedDriveReader(DriveModel("probe", 1e6, lat_us=0.0), clock, {"": b""})
    buf = aligned_buffer(ALIGN)
    times = []
    for i in range(calls + 20):
        t = time.perf_counter()
        probe.read_into("", 0, buf)
        if i >= 20:  # the first calls pay for imports and timer-slack setup
            times.append(time.perf_counter() - t)
    return min(statistics.median(times), 20e-6)


class EmulatedDriveSet:
    """A set of emulated drives sharing one sleep clock. ``readers()[i]`` is drive i."""

    def __init__(self, models: Sequence[DriveModel], *, memory: Mapping[str, bytes] | None = None, seed: int = 0,
                 clock=None):
        """``clock``: anything with ``now()``, ``sleep_until(deadline) -> seconds late`` and ``overhead``
        (default: the machine's monotonic clock, its overhead measured); tests pass a virtual one."""
        if not models:
            raise UsageError("an emulated drive set needs at least one drive; e.g. --emulate-drives report4@0.04")
        self.models = tuple(models)
        if clock is None:
            clock = _Clock()
            clock.overhead = _measure_overhead(clock)
        self._readers = [EmulatedDriveReader(m, clock, memory, seed + 7919 * i) for i, m in enumerate(self.models)]

    @classmethod
    def from_spec(cls, spec: str, *, scale: float | None = None, memory: Mapping[str, bytes] | None = None,
                  seed: int = 0) -> EmulatedDriveSet:
        return cls(parse_spec(spec, scale), memory=memory, seed=seed)

    def readers(self) -> list[EmulatedDriveReader]:
        return list(self._readers)

    def drive_specs(self) -> list[DriveSpec]:
        """The drives as placement sees them (label, rate)."""
        return [m.to_drive_spec() for m in self.models]

    @property
    def summed_gbps(self) -> float:
        return sum(m.gbps for m in self.models)

    def stats(self) -> list[dict]:
        return [r.stats() for r in self._readers]


def emulated_readers(spec: str, packed=None, *, scale: float | None = None, seed: int = 0
                     ) -> list[EmulatedDriveReader]:
    """Readers for ``--emulate-drives SPEC``, one per drive of ``packed`` (anything with
    ``.drives``, each with ``.label``), in the packed model's drive order.

    Emulated drives are matched to the model's drives by label when every label matches, else by
    position; the counts must agree. Each reader serves the real files at modelled speed.
    """
    models = parse_spec(spec, scale)
    if packed is None:
        return EmulatedDriveSet(models, seed=seed).readers()
    labels = [d.label for d in packed.drives]
    if len(models) != len(labels):
        raise UsageError(f"--emulate-drives describes {len(models)} drive(s) but the model is on {len(labels)} "
                         f"({', '.join(labels)}); give one emulated drive per model drive, e.g. "
                         f"'{labels[0]}:6GBps;...'")
    by_label = {m.label: m for m in models}
    if set(by_label) == set(labels):
        models = tuple(by_label[x] for x in labels)
    else:
        log.info("--emulate-drives: labels %s differ from the model's %s; matching by position",
                 [m.label for m in models], labels)
    return EmulatedDriveSet(models, seed=seed).readers()
