"""The reads of one layer's fetch: every miss in flight with a deadline, then retries and failover.

A whole-file read that fails (I/O error, short read, checksum mismatch: the checksum runs in the reader
thread) moves on to the expert's next copy. A read that misses its deadline (``ReadDeadline``) is retried
once on its drive, then moved on to the next copy. With no copy left, the fetch raises an error naming the
drive, the file, the offset and the seconds waited. A striped expert's pieces have no other copy: a late
piece is retried once, then reported; the assembled expert is checked against its checksum.

The first good answer for an expert wins. Answers from reads given up on are dropped (a whole read's
buffer goes back to the pool; a striped buffer that a late piece may still write into is retired).
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from dataclasses import dataclass

import xxhash

from deltafin.errors import DeltafinError, ReadError
from deltafin.io.pool import Checksum, Completion
from deltafin.io.schedule import Piece, ReadRequest, ScheduledRead, schedule_layer
from deltafin.store import expert_file as ef

log = logging.getLogger(__name__)

SLOW_FIX = "check the drive (kernel log, cable, enclosure), or raise --read-deadline if it is only slow"


@dataclass(slots=True)
class _Attempt:
    expert: int
    drive: int
    path: str
    nbytes: int
    started: float
    deadline: float
    piece: Piece | None = None


class _Striped:
    """A striped expert being read: its pieces fill one buffer; delivered when the last one lands."""

    __slots__ = ("expert", "buf", "left")

    def __init__(self, expert: int, buf: memoryview, pieces: int):
        self.expert, self.buf, self.left = expert, buf, pieces


def _rank_order(queues) -> list[ScheduledRead]:
    """Every drive's first read, then every drive's second, ...: all drives start at once."""
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


class LayerReads:
    """The misses of one ``fetch(layer, ids)`` on ``src`` (a StreamingExperts); ``next()`` returns each
    expert as it lands: (expert, buffer, bytes, name)."""

    def __init__(self, src, layer: int, misses: list[int], checks_later: bool = False):
        self.src, self.layer = src, layer
        # files mapped from drives in memory land unchecked (``unchecked``), for the consumer to have checked later
        # (``runtime.source.LaterChecked``); every other read is checked in the reader threads as before
        self.checks_later = checks_later
        self.unchecked: set[int] = set()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.left = set(misses)
        self.live: dict[int, _Attempt] = {}  # attempt id -> read in flight
        self.given_up: dict[int, _Attempt] = {}  # timed out, may still answer
        self.tried: dict[int, list[int]] = {}  # expert -> drives tried, in order (whole reads)
        self.failures: dict[int, list[Exception]] = {}
        self.timeouts: dict[tuple[int, int], int] = {}
        self.striped: dict[int, _Striped] = {}
        self.came_from: dict[int, int] = {}  # expert -> the drive whose copy landed (whole reads)
        self._ids = itertools.count()
        # reads wait in their lane (a drive's whole files, or a striped layer's experts) until fewer than ``ahead``
        # of its experts are read or being read and not yet taken by the consumer: a consumer slower than the drives
        # (the CPU's math) holds that many buffers, not the whole layer's (fresh buffers cost a page fault per 4 KiB)
        self.ahead = getattr(src, "read_ahead", None)
        self._queued: list[list[list[ScheduledRead]]] = []  # per lane, experts' reads not yet submitted, last first
        self._open: list[int] = []  # per lane, experts submitted and not yet returned by next()
        self._home: dict[int, int] = {}  # expert -> the lane its first read was queued in
        self.unwanted: set[int] = set()  # experts read on a guess that the layer's fetch did not ask for (narrow)
        self._skipped: set[int] = set()  # unwanted experts whose read has ended (landed, failed or given up)
        self._start(misses)

    # -------------------------------------------------------------- submitting

    def _start(self, misses: list[int]) -> None:
        m = self.src.model
        pieces = m.stripe(self.layer)
        if pieces is None:
            reqs = [ReadRequest(e, m.file_bytes(self.layer), replicas=tuple(m.locations(self.layer, e)))
                    for e in misses]
        else:
            reqs = [ReadRequest(e, m.file_bytes(self.layer), pieces=pieces) for e in misses]
        sched = schedule_layer(reqs, self.src._rates, self.src.pool.pending_bytes(), self.src._latency)
        if pieces is None:  # a lane per drive, a whole file per unit
            lanes = [[[r] for r in q] for q in sched.queues]
        else:  # one lane: a striped expert's pieces go together (it lands when they all have), on every drive
            units: dict[int, list[ScheduledRead]] = {}
            for r in _rank_order(sched.queues):
                units.setdefault(r.expert, []).append(r)
            lanes = [list(units.values())]
        self._striped_layer = pieces is not None
        self._queued = [list(reversed(q)) for q in lanes]
        self._open = [0] * len(lanes)
        self._top_up()

    def _top_up(self) -> None:
        """Submit each lane's next experts, in schedule order, while it has fewer than ``ahead`` experts open (0:
        no limit). A lane is a drive's whole-file reads, or a striped layer's experts (each a piece per drive, so
        each drive again reads at most ``ahead`` pieces ahead); a striped expert's buffer is taken when it goes."""
        for d, q in enumerate(self._queued):
            while q and (not self.ahead or self._open[d] < self.ahead):
                unit = q.pop()
                e = unit[0].expert
                self._open[d] += 1
                self._home[e] = d
                if not self._striped_layer:
                    self._submit(e, unit[0].drive)
                    continue
                nbytes = self.src.model.file_bytes(self.layer)
                self.striped[e] = _Striped(e, self._striped_buffer(e, nbytes), len(unit))
                for r in unit:
                    self._submit(e, r.drive, Piece(r.drive, r.offset, r.nbytes))

    def _striped_buffer(self, e: int, nbytes: int) -> memoryview:
        try:
            return self.src.pool.buffers.get(nbytes)
        except (MemoryError, OverflowError, OSError, ValueError) as err:
            raise ReadError(f"layer {self.layer} expert {e}: cannot allocate a {nbytes:,}-byte buffer ({err}); the "
                            f"model's manifest gives that size: run 'deltafin verify' on the model") from err

    def _submit(self, e: int, drive: int, piece: Piece | None = None) -> None:
        src, layer = self.src, self.layer
        check = into = None
        if piece is None:
            path, nbytes = src.model.expert_path(layer, e, drive), src.model.file_bytes(layer)
            self.tried.setdefault(e, []).append(drive)
            if src.verify and not getattr(src, "gpu_checks", False):  # else checked in its slab slot, on the GPU
                check = _checker(src.model.checksum(layer, e), path, src.repair_fix)
        else:
            path, nbytes = src.model.piece_path(layer, e, piece), piece.nbytes
            into = self.striped[e].buf[piece.offset : piece.offset + piece.nbytes]
        aid = next(self._ids)
        now = time.monotonic()
        later = check is not None and self.checks_later
        view = (src.pool.mapped_now(drive, path, nbytes, count=not later)
                if piece is None and (check is None or later) else None)
        if view is not None:  # a file in memory, checked later or not at all: landed now, in this thread
            if later:
                self.unchecked.add(e)
            self.live[aid] = _Attempt(e, drive, path, nbytes, now, now + src.deadline.seconds(nbytes, 1.0), piece)
            self.done.put(Completion(aid, drive, path, view, nbytes, 0.0))
            return
        self.unchecked.discard(e)
        ahead = src.pool.submit(drive, path, nbytes, aid, self.done, into, check)
        rate = deadline_rate(src._rates[drive], src.pool.counters[drive])
        due = now + src.deadline.seconds(ahead + nbytes, rate, src._latency[drive])
        self.live[aid] = _Attempt(e, drive, path, nbytes, now, due, piece)

    def narrow(self, wanted) -> int:
        """Read only the experts of ``wanted`` from now on: the fetch of a layer read ahead on a guess (or on known
        routes) asks for some of them. The others' reads not yet submitted are dropped, those no thread has
        started are cancelled, and those under way are skipped by ``next()`` when they land (their buffers go back
        to the pool; a failure or a late answer of theirs is forgotten). Returns the reads cancelled."""
        drop = self.left - set(wanted)
        if not drop:
            return 0
        self.unwanted |= drop
        self.left -= drop
        for q in self._queued:
            q[:] = [u for u in q if u[0].expert not in drop]
        cancelled = 0
        for aid, a in list(self.live.items()):
            # a striped expert's pieces land together or not at all: those are left to land and be skipped
            if a.expert in drop and a.piece is None and self.src.pool.cancel(a.drive, aid, self.done):
                del self.live[aid]
                self._ended(a.expert)
                cancelled += 1
        return cancelled

    def _ended(self, e: int) -> None:
        """An unwanted expert's read is over: its lane may read further."""
        if e not in self._skipped:
            self._skipped.add(e)
            self._open[self._home[e]] -= 1

    def _drop(self, a: _Attempt) -> bool:
        """A read of an unwanted expert that failed or is late: forgotten, no retry, no error (True)."""
        if a.expert not in self.unwanted:
            return False
        self._ended(a.expert)
        return True

    def _skip(self, landed: tuple[int, memoryview, int, str]) -> None:
        self._ended(landed[0])
        self.src.pool.buffers.put(landed[1])

    @property
    def in_flight(self) -> bool:
        return bool(self.live)

    def poll(self) -> bool:
        """Take, without waiting, the answers already in for a narrowed read's unwanted experts (their buffers back
        to the pool); True once none is in flight."""
        while self.live or self.given_up:
            try:
                c = self.done.get_nowait()
            except queue.Empty:
                break
            landed = self._completed(c)
            if landed is not None:
                self._skip(landed)
        now = time.monotonic()
        for aid, a in list(self.live.items()):
            if a.deadline <= now:
                self.given_up[aid] = self.live.pop(aid)
                self._drop(a)
        return not self.live

    # -------------------------------------------------------------- waiting

    def next(self) -> tuple[int, memoryview, int, str]:
        """The next expert to land; raises the error of an expert none of whose copies could be read."""
        self._top_up()  # the consumer is done with the expert before this one: its lane may read further
        while True:
            assert self.live, "experts left with no read in flight"
            wait = min(a.deadline for a in self.live.values()) - time.monotonic()
            try:
                c = self.done.get(timeout=min(max(wait, 0.0), 60.0))  # the OS caps timeouts; loop past it
            except queue.Empty:
                self._expire(time.monotonic())
                continue
            landed = self._completed(c)
            if landed is None:
                continue
            if landed[0] in self.unwanted:
                self._skip(landed)
                continue
            self._open[self._home[landed[0]]] -= 1
            return landed

    def _completed(self, c: Completion) -> tuple[int, memoryview, int, str] | None:
        a = self.live.pop(c.tag, None)
        if a is None:
            return self._late(c)
        if c.error is not None:
            if not self._drop(a):
                self._failed(a, c.error)
            return None
        return self._landed(a, c)

    def _late(self, c: Completion) -> tuple[int, memoryview, int, str] | None:
        """An answer from a read given up on: still the first good copy if its expert is not done."""
        a = self.given_up.pop(c.tag)
        if a.piece is None and c.error is None and a.expert in self.left:
            for aid, other in list(self.live.items()):  # the retry or the next copy is now redundant
                if other.expert == a.expert:
                    self.given_up[aid] = self.live.pop(aid)
            return self._landed(a, c)
        if a.piece is None and c.buf is not None:
            self.src.pool.buffers.put(c.buf)
        return None

    def _landed(self, a: _Attempt, c: Completion) -> tuple[int, memoryview, int, str] | None:
        if a.piece is None:
            self.left.discard(a.expert)
            self.came_from[a.expert] = a.drive
            return a.expert, c.buf, c.nbytes, c.path
        st = self.striped[a.expert]
        st.left -= 1
        if st.left:
            return None
        m = self.src.model
        nbytes = m.file_bytes(self.layer)
        labels = ", ".join(self.src.readers[p.drive].label for p in m.stripe(self.layer))
        where = f"layer {self.layer} expert {st.expert} (pieces on {labels})"
        if self.src.verify:
            ef.check(st.buf[:nbytes], m.checksum(self.layer, st.expert), where, self.src.repair_fix)
        self.left.discard(st.expert)
        return st.expert, st.buf, nbytes, where

    def reread(self, e: int, err: Exception) -> tuple[memoryview, int, str]:
        """A copy of expert ``e`` that landed failed its check afterwards (on the GPU, or in the consumer): read its
        next copy and check it here, on the host, until one matches. Returns (buffer, bytes, name); raises like a
        mismatch found in the reader threads (``err`` alone when there is no other copy). Called once the
        layer's other reads have landed."""
        expected = self.src.model.checksum(self.layer, e)
        while True:
            self.left.add(e)
            self._open[self._home[e]] += 1
            self._next_copy(_Attempt(e, self.came_from[e], "", 0, 0.0, 0.0), err)
            _, buf, nbytes, where = self.next()
            got = xxhash.xxh3_64_hexdigest(buf[:nbytes])
            if got == expected:
                return buf, nbytes, where
            self.src.pool.buffers.put(buf)
            err = ef.checksum_error(where, expected, got, self.src.repair_fix)

    # -------------------------------------------------------------- failures

    def _failed(self, a: _Attempt, err: Exception) -> None:
        label = self.src.readers[a.drive].label
        if a.piece is not None:
            what = err if isinstance(err, DeltafinError) else f"drive {label}: read of {a.path} failed: {err}"
            raise ReadError(f"{what} (the piece at byte {a.piece.offset} of layer {self.layer} expert {a.expert}, "
                            f"striped with no other copy; run 'deltafin verify')") from err
        if not isinstance(err, DeltafinError):
            err = ReadError(f"drive {label}: read of {a.path} failed: {err}")
        self._next_copy(a, err)

    def _next_copy(self, a: _Attempt, err: Exception) -> None:
        """Read the expert from its next untried copy, or raise: every copy failed."""
        e = a.expert
        self.failures.setdefault(e, []).append(err)
        self.src.stats.failed_reads += 1
        rest = [d for d in self.src.model.locations(self.layer, e) if d not in self.tried[e]]
        if rest:
            log.warning("%s; reading the copy on drive %s", err, self.src.readers[rest[0]].label)
            self._submit(e, rest[0])
            return
        errs = self.failures[e]
        if len(errs) == 1:
            raise errs[0]
        raise ReadError(f"layer {self.layer} expert {e}: no copy could be read ({len(errs)} tried): "
                        + "; ".join(map(str, errs))) from errs[-1]

    def _expire(self, now: float) -> None:
        for aid, a in list(self.live.items()):
            if a.deadline > now:
                continue
            self.given_up[aid] = self.live.pop(aid)
            if self._drop(a):
                continue
            self.src.stats.late_reads += 1
            key = (a.expert, a.drive if a.piece is None else a.piece.offset)
            n = self.timeouts[key] = self.timeouts.get(key, 0) + 1
            label = self.src.readers[a.drive].label
            msg = (f"drive {label}: read of {a.path} (offset 0, {a.nbytes:,} bytes) did not complete in "
                   f"{now - a.started:.1f} s")
            if a.piece is not None:
                self.src.pool.buffers.retire(self.striped[a.expert].buf)  # the late read may still write to it
            if n == 1:
                log.warning("%s; retrying it", msg)
                self._submit(a.expert, a.drive, a.piece)
            elif a.piece is None:
                self._next_copy(a, ReadError(f"{msg}, twice; {SLOW_FIX}"))
            else:
                raise ReadError(f"{msg}, twice (the piece at byte {a.piece.offset} of layer {self.layer} expert "
                                f"{a.expert}, striped with no other copy); {SLOW_FIX}")


def deadline_rate(gbps: float, seen, min_bytes: int = 256 << 20) -> float:
    """The rate a deadline assumes for a drive: its known rate (manifest or emulated model), or the rate the
    drive has actually delivered in this run once it has read ``min_bytes``, whichever is lower (a rate
    measured on another day, or given by hand, must not make honest reads look late)."""
    rate = gbps if gbps > 0 else 0.1
    if seen.bytes >= min_bytes and seen.active_seconds > 0:
        rate = min(rate, seen.bytes / seen.active_seconds / 1e9)
    return rate


def _checker(expected: str, path: str, fix: str) -> Checksum:
    return Checksum(expected, lambda got: ef.checksum_error(path, expected, got, fix))
