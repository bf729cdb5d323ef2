"""Calibration: measure a real disk (or any ``DriveReader``) and fit the emulator's ``DriveModel`` to it.

``calibrate(path)`` measures the disk holding ``path`` with direct reads and returns a ``DriveModel``
that reproduces its rate and latency; ``measure_reader`` runs the same measurement on any reader, so an
emulated drive can be checked against the disk it was fitted to.
"""

from __future__ import annotations

import logging
import math
import os
import random
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from deltafin.io.direct import ALIGN, FileDriveReader, aligned_buffer
from deltafin.io.emulator import DriveModel

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Measurement:
    """Random aligned reads of ``size`` bytes with ``qd`` in flight, for a fixed time."""

    size: int
    qd: int
    reads: int
    gbps: float
    lat_mean_us: float
    lat_p50_us: float
    lat_p90_us: float
    lat_p99_us: float


@dataclass(frozen=True, slots=True)
class Calibration:
    model: DriveModel
    points: tuple[Measurement, ...]
    direct: bool  # False: the filesystem refused O_DIRECT and the figures include the page cache

    def point(self, size: int, qd: int) -> Measurement:
        return next(p for p in self.points if p.size == size and p.qd == qd)


def _pct(sorted_xs: list[float], q: float) -> float:
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]


def measure_reader(reader, path: str, *, size: int, qd: int, seconds: float = 0.3, seed: int = 0) -> Measurement:
    """Measure a ``DriveReader`` on ``path``: random ``size``-aligned reads, ``qd`` threads."""
    if size % ALIGN or size <= 0:
        raise ValueError(f"measurement size {size} must be a positive multiple of {ALIGN}")
    slots = os.path.getsize(path) // size
    if slots < 1:
        raise ValueError(f"{path} is smaller than one read of {size} bytes; use a larger test file")
    lats: list[float] = []
    moved = [0]
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def worker(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        buf = aligned_buffer(size)
        mine, got = [], 0
        while time.monotonic() < stop:
            t = time.perf_counter()
            got += reader.read_into(path, rng.randrange(slots) * size, buf)
            mine.append(time.perf_counter() - t)
        with lock:
            lats.extend(mine)
            moved[0] += got

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(qd)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    lats.sort()
    us = [x * 1e6 for x in lats] or [0.0]
    return Measurement(size, qd, len(lats), moved[0] / elapsed / 1e9, statistics.fmean(us),
                       _pct(us, 0.5), _pct(us, 0.9), _pct(us, 0.99))


def write_test_file(path: str, nbytes: int = 32 << 20) -> str:
    """Write ``nbytes`` of random data to ``path`` (fsynced) for measurements; return the path."""
    nbytes = nbytes // ALIGN * ALIGN
    with open(path, "wb") as f:
        left = nbytes
        while left:
            chunk = min(left, 1 << 20)
            f.write(os.urandom(chunk))
            left -= chunk
        f.flush()
        os.fsync(f.fileno())
    return path


def fit_model(points: Sequence[Measurement], small: int, big: int, label: str = "disk") -> DriveModel:
    """Drive model reproducing measured points: rate from the big reads at the deepest queue,
    latency and jitter from small reads at qd 1, an IOPS cap from small reads at depth."""
    rate = max((p for p in points if p.size == big), key=lambda p: p.qd).gbps
    qd1 = next(p for p in points if p.size == small and p.qd == 1)
    probe = DriveModel(label, rate, lat_us=0.0)
    iops = 0.0
    deep = [p for p in points if p.size == small and p.qd > 1]
    if deep:
        p = max(deep, key=lambda p: p.qd)
        measured_iops = p.gbps * 1e9 / small
        unc = DriveModel(label, rate, lat_us=max(0.0, qd1.lat_mean_us - probe.service_s(small) * 1e6))
        if measured_iops < 0.9 * unc.rate_at(p.qd, small) * 1e9 / small:
            iops = measured_iops  # the drive (or the host) caps reads per second below what latency allows
    svc_us = DriveModel(label, rate, lat_us=0.0, iops=iops).service_s(small) * 1e6
    lat, jitter, slow_p, slow_x = _fit_latency(qd1, svc_us)
    return DriveModel(label, rate, lat_us=round(lat, 2), jitter=round(jitter, 4), slow_p=round(slow_p, 5),
                      slow_x=round(slow_x, 2), iops=round(iops, 1))


def _fit_latency(p: Measurement, svc_us: float) -> tuple[float, float, float, float]:
    """(lat_us, jitter, slow_p, slow_x) for qd-1 reads taking ``svc_us`` on the bus: a lognormal
    latency from the p50 and p90, plus rare slow reads carrying what it leaves of the mean, as
    slow as the p99 (z(0.9) = 1.2816)."""
    x50 = max(1.0, p.lat_p50_us - svc_us)
    x90 = max(x50, p.lat_p90_us - svc_us)
    jitter = math.log(x90 / x50) / 1.2816
    lat = x50 * math.exp(jitter**2 / 2)  # the lognormal's mean, from its median
    body = lat + svc_us
    excess = p.lat_mean_us / body - 1.0
    slow_x = p.lat_p99_us / body
    if excess < 0.02 or slow_x < 1.25:
        return lat, jitter, 0.0, 1.0
    return lat, jitter, min(0.2, excess / (slow_x - 1.0)), slow_x


def calibrate(path: str, *, seconds: float = 0.3, small: int = 4096, big: int = 1 << 20, big_qd: int = 4,
              deep_qd: int = 8, label: str = "disk") -> Calibration:
    """Measure the disk holding ``path`` (an existing test file) with direct reads; fit a drive model.

    Points measured: (small, qd 1) for latency, (big, 1) and (big, ``big_qd``) for rate, and
    (small, ``deep_qd``) to find an IOPS cap. ``seconds`` per point.
    """
    reader = FileDriveReader(label, os.path.dirname(os.path.abspath(path)), direct=True)
    if not reader.direct:
        log.warning("calibrate: %s refuses O_DIRECT; figures include the page cache", path)
    plan = [(small, 1), (big, 1), (big, big_qd), (small, deep_qd)]
    points = tuple(measure_reader(reader, path, size=s, qd=q, seconds=seconds) for s, q in plan)
    model = fit_model(points, small, big, label)
    log.info("calibrate: %s -> %s", path, model.spec())
    return Calibration(model, points, reader.direct)
