"""Scheduling one MoE layer's expert reads over drives. Plain Python: no torch, no files.

A layer waits for its slowest read, so the scheduler picks, for each expert, where to read it from
(one of its replicas, or a fixed striping plan of pieces) to minimise the layer's completion time
(makespan) given each drive's rate and the bytes already queued on it.

Cost model: a drive with rate r (bytes/s), q bytes already queued and per-read latency l finishes
its queue at ``l + (q + assigned bytes) / r`` (reads in flight overlap their latencies).

Order rule: every drive issues its reads by (priority, expert size, expert id), the same key on
every drive. Smallest-first gets the most experts ready soonest so math starts early, and pieces
of one striped expert sit at the same rank on every drive, so the expert completes as a whole.

Striping is a read-time layout: ``stripe_bandwidth`` cuts an expert into 4 KiB-aligned pieces
proportional to drive rates; ``stripe_equal`` is the RAID-0-like baseline (equal pieces).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

ALIGN = 4096
LAYOUTS = ("placed", "stripe", "raid0")


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes ``[offset, offset + nbytes)`` of an expert's payload, read from ``drive``."""

    drive: int
    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.drive < 0 or self.offset < 0 or self.nbytes <= 0:
            raise ValueError(f"bad piece {self}: drive and offset must be >= 0 and nbytes > 0")


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """One expert to read: either from one of ``replicas`` (whole copies) or as ``pieces``."""

    expert: int
    nbytes: int
    replicas: tuple[int, ...] = ()
    pieces: tuple[Piece, ...] = ()
    priority: int = 0  # lower is needed sooner (0: this token; higher: prefetch)

    def __post_init__(self) -> None:
        if self.nbytes <= 0:
            raise ValueError(f"expert {self.expert}: nbytes must be > 0, got {self.nbytes}")
        if bool(self.replicas) == bool(self.pieces):
            raise ValueError(f"expert {self.expert}: give either replicas (drive indices) or pieces, not "
                             f"{'both' if self.replicas else 'neither'}")
        if len(set(self.replicas)) != len(self.replicas) or any(d < 0 for d in self.replicas):
            raise ValueError(f"expert {self.expert}: replicas {self.replicas} must be distinct drive indices")
        if self.pieces and sum(p.nbytes for p in self.pieces) != self.nbytes:
            raise ValueError(f"expert {self.expert}: pieces sum to {sum(p.nbytes for p in self.pieces)} bytes, "
                             f"not {self.nbytes}")


class ScheduledRead(NamedTuple):
    """One read in a drive's queue (a tuple: layers of a prefill hold thousands)."""

    expert: int
    drive: int
    offset: int
    nbytes: int
    finish_s: float  # predicted completion, seconds from now


@dataclass(frozen=True, slots=True)
class LayerSchedule:
    """Per-drive read queues in issue order, with the predicted and ideal completion times."""

    queues: tuple[tuple[ScheduledRead, ...], ...]
    makespan_s: float
    ideal_s: float  # max(queued / rate per drive, (queued + layer bytes) / summed rate)
    drive_finish_s: tuple[float, ...]

    @property
    def efficiency(self) -> float:
        """ideal / makespan: 1.0 when the layer uses the summed read rate fully."""
        return self.ideal_s / self.makespan_s if self.makespan_s > 0 else 1.0

    def drives_of(self, expert: int) -> list[int]:
        return sorted({r.drive for q in self.queues for r in q if r.expert == expert})


# ---------------------------------------------------------------- striping arithmetic


def _split_units(units: int, weights: Sequence[float]) -> list[int]:
    """Largest-remainder split of ``units`` in proportion to ``weights`` (ties to lower index)."""
    total = sum(weights)
    shares = [units * w / total for w in weights]
    counts = [int(s) for s in shares]
    order = sorted(range(len(weights)), key=lambda i: (-(shares[i] - counts[i]), i))
    for i in order[: units - sum(counts)]:
        counts[i] += 1
    return counts


def _pieces(nbytes: int, counts: list[int], align: int) -> tuple[Piece, ...]:
    out, offset = [], 0
    for drive, n in enumerate(counts):
        length = min(n * align, nbytes - offset)
        if length > 0:
            out.append(Piece(drive, offset, length))
            offset += length
    assert offset == nbytes
    return tuple(out)


def stripe_bandwidth(nbytes: int, rates_gbps: Sequence[float], align: int = ALIGN) -> tuple[Piece, ...]:
    """Cut ``nbytes`` into one piece per drive, sized in proportion to the drive's rate.

    Pieces are contiguous, start on ``align`` boundaries and are whole multiples of ``align``
    except the last one when ``nbytes`` is not aligned. Drives whose share rounds to 0 get none.
    """
    if nbytes <= 0 or not rates_gbps or any(r <= 0 for r in rates_gbps):
        raise ValueError(f"stripe_bandwidth: need nbytes > 0 and rates > 0, got {nbytes}, {list(rates_gbps)}")
    units = -(-nbytes // align)
    return _pieces(nbytes, _split_units(units, rates_gbps), align)


def stripe_equal(nbytes: int, ndrives: int, align: int = ALIGN) -> tuple[Piece, ...]:
    """RAID-0-like baseline: equal aligned pieces on every drive, whatever its rate."""
    if nbytes <= 0 or ndrives <= 0:
        raise ValueError(f"stripe_equal: need nbytes > 0 and ndrives > 0, got {nbytes}, {ndrives}")
    units = -(-nbytes // align)
    return _pieces(nbytes, _split_units(units, [1.0] * ndrives), align)


def layer_requests(experts: Sequence[int], sizes: Sequence[int], locations: Sequence[Sequence[int]],
                   layout: str = "placed", rates_gbps: Sequence[float] | None = None,
                   priority: int = 0) -> list[ReadRequest]:
    """Read requests for ``experts`` of one layer.

    ``layout``: "placed" reads whole files from the placement's drives (``locations[e]``, primary
    first, replicas after); "stripe" cuts each expert over all drives by rate; "raid0" cuts it
    into equal pieces over all drives.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown read layout {layout!r}; known: {', '.join(LAYOUTS)}")
    if layout != "placed" and not rates_gbps:
        raise ValueError(f"layout {layout!r} needs the drive rates")
    out = []
    plans: dict[int, tuple[Piece, ...]] = {}  # experts of one size share a striping plan
    for e in experts:
        n = sizes[e]
        if layout == "placed":
            out.append(ReadRequest(e, n, replicas=tuple(locations[e]), priority=priority))
            continue
        if n not in plans:
            plans[n] = stripe_bandwidth(n, rates_gbps) if layout == "stripe" else stripe_equal(n, len(rates_gbps))
        out.append(ReadRequest(e, n, pieces=plans[n], priority=priority))
    return out


# ---------------------------------------------------------------- assignment


def _check_drives(requests: Sequence[ReadRequest], ndrives: int) -> None:
    for r in requests:
        used = r.replicas or tuple(p.drive for p in r.pieces)
        bad = [d for d in used if d >= ndrives]
        if bad:
            raise ValueError(f"expert {r.expert}: drive index {bad[0]} out of range for {ndrives} drives")


def _assign(requests: Sequence[ReadRequest], bps: list[float], load: list[float], lat: list[float]
            ) -> list[tuple[ReadRequest, int]]:
    """Greedy longest-first assignment of whole-copy reads; pieces are fixed. Mutates ``load``."""
    chosen: list[tuple[ReadRequest, int]] = []
    for r in requests:
        for p in r.pieces:
            load[p.drive] += p.nbytes
    flexible = sorted((r for r in requests if r.replicas), key=lambda r: (len(r.replicas), -r.nbytes, r.expert))
    for r in flexible:
        d = min(r.replicas, key=lambda d: (lat[d] + (load[d] + r.nbytes) / bps[d], d))
        load[d] += r.nbytes
        chosen.append((r, d))
    return chosen


def _peak_after(moves: list[tuple[int, float]], load: list[float], bps: list[float], lat: list[float]) -> float:
    """Latest finish among the drives touched by ``moves`` (drive, byte delta)."""
    delta: dict[int, float] = {}
    for d, b in moves:
        delta[d] = delta.get(d, 0.0) + b
    return max(lat[d] + (load[d] + b) / bps[d] for d, b in delta.items())


def _best_move(chosen, worst: int, peak: float, load, bps, lat):
    best, best_peak = None, peak
    for i, (r, d) in enumerate(chosen):
        if d != worst:
            continue
        for alt in r.replicas:
            if alt != worst:
                p = _peak_after([(worst, -r.nbytes), (alt, r.nbytes)], load, bps, lat)
                if p < best_peak - 1e-12:
                    best, best_peak = [(i, alt)], p
    return best, best_peak


def _best_swap(chosen, worst: int, peak: float, load, bps, lat):
    best, best_peak = None, peak
    for i, (a, da) in enumerate(chosen):
        if da != worst:
            continue
        for j, (b, db) in enumerate(chosen):
            if db == worst or db not in a.replicas or worst not in b.replicas or b.nbytes >= a.nbytes:
                continue
            p = _peak_after([(worst, b.nbytes - a.nbytes), (db, a.nbytes - b.nbytes)], load, bps, lat)
            if p < best_peak - 1e-12:
                best, best_peak = [(i, db), (j, worst)], p
    return best, best_peak


def _improve(chosen: list[tuple[ReadRequest, int]], bps: list[float], load: list[float], lat: list[float],
             rounds: int = 64, swap_limit: int = 256) -> None:
    """Local search on the latest-finishing drive: move one read elsewhere, or swap a larger read
    there with a smaller one elsewhere, while that lowers the makespan."""
    busy = [d for d in range(len(bps)) if load[d] > 0]
    for _ in range(rounds):
        worst = max(busy, key=lambda d: lat[d] + load[d] / bps[d], default=None)
        if worst is None:
            return
        peak = lat[worst] + load[worst] / bps[worst]
        step, _p = _best_move(chosen, worst, peak, load, bps, lat)
        if step is None and len(chosen) <= swap_limit:
            step, _p = _best_swap(chosen, worst, peak, load, bps, lat)
        if step is None:
            return
        for i, d in step:
            r, old = chosen[i]
            load[old] -= r.nbytes
            load[d] += r.nbytes
            chosen[i] = (r, d)
        busy = [d for d in range(len(bps)) if load[d] > 0]


def schedule_layer(requests: Sequence[ReadRequest], rates_gbps: Sequence[float],
                   queued_bytes: Sequence[float] | None = None,
                   latency_s: Sequence[float] | None = None) -> LayerSchedule:
    """Choose a location for every read of one layer and order each drive's queue.

    ``rates_gbps[d]`` is drive d's rate, ``queued_bytes[d]`` what it must still read before this
    layer's reads, ``latency_s[d]`` its per-read latency. Returns per-drive queues (issue order:
    priority, then smallest expert first), the predicted makespan and the ideal.
    """
    n = len(rates_gbps)
    if n == 0 or any(r <= 0 for r in rates_gbps):
        raise ValueError(f"schedule_layer: need at least one drive with rate > 0, got {list(rates_gbps)}")
    _check_drives(requests, n)
    bps = [r * 1e9 for r in rates_gbps]
    queued = [float(q) for q in (queued_bytes or [0.0] * n)]
    lat = [float(x) for x in (latency_s or [0.0] * n)]
    load = list(queued)
    chosen = _assign(requests, bps, load, lat)
    _improve(chosen, bps, load, lat)
    queues = _order(requests, chosen, n)
    timed, finish = _time_queues(queues, bps, queued, lat)
    layer_bytes = sum(r.nbytes for r in requests)
    ideal = max(max(q / b for q, b in zip(queued, bps, strict=True)), (sum(queued) + layer_bytes) / sum(bps))
    return LayerSchedule(timed, max(finish, default=0.0), ideal, tuple(finish))


def _order(requests: Sequence[ReadRequest], chosen: list[tuple[ReadRequest, int]], n: int
           ) -> list[list[tuple[tuple, int, int, int]]]:
    queues: list[list[tuple[tuple, int, int, int]]] = [[] for _ in range(n)]
    for r, d in chosen:
        queues[d].append(((r.priority, r.nbytes, r.expert), r.expert, 0, r.nbytes))
    for r in requests:
        for p in r.pieces:
            queues[p.drive].append(((r.priority, r.nbytes, r.expert, p.offset), r.expert, p.offset, p.nbytes))
    for q in queues:
        q.sort(key=lambda x: x[0])
    return queues


def _time_queues(queues, bps: list[float], queued: list[float], lat: list[float]):
    timed, finish = [], []
    for d, q in enumerate(queues):
        done = queued[d]
        row = []
        for _key, expert, offset, nbytes in q:
            done += nbytes
            row.append(ScheduledRead(expert, d, offset, nbytes, lat[d] + done / bps[d]))
        timed.append(tuple(row))
        finish.append(row[-1].finish_s if row else queued[d] / bps[d])
    return tuple(timed), finish
