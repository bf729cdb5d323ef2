"""Reader threads per drive, reusable aligned buffers, and completions delivered as reads land.

Whatever goes wrong in a reader thread (the buffer allocation included) becomes a Completion with its
error: a consumer waiting on the completion queue always hears back, and ``ReadDeadline`` bounds how long
it waits for a read that never returns.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

from deltafin.errors import ReadError
from deltafin.io import hashing
from deltafin.io.direct import ALIGN, DriveReader, align_up, aligned_buffer


class BufferPool:
    """Aligned host buffers reused across reads (no allocation per read in steady state).

    With ``pin=True`` buffers are page-locked host memory from torch (CUDA), so host-to-device copies run
    asynchronously; torch owns their lifetime.
    """

    def __init__(self, pin: bool = False):
        self.pin = pin
        self._free: dict[int, list[memoryview]] = defaultdict(list)
        self._lock = threading.Lock()
        self._retired: dict[int, memoryview] = {}
        self.allocated = 0

    def get(self, nbytes: int) -> memoryview:
        size = align_up(nbytes)
        with self._lock:
            if self._free[size]:
                return self._free[size].pop()
            self.allocated += size
        return _pinned_buffer(size) if self.pin else aligned_buffer(size, huge=True)

    def reserve(self, nbytes: int, count: int) -> int:
        """Have at least ``count`` free buffers of ``nbytes`` (aligned up), their pages mapped now: a read into a
        fresh buffer otherwise faults its pages in one at a time inside the read (and a pinned buffer taken on
        demand costs a page-locking allocation inside the read). A pinned pool takes them as one page-locked
        allocation. Returns the buffers added."""
        if count <= 0:
            return 0
        size = align_up(nbytes)
        with self._lock:
            need = count - len(self._free[size])
        if need <= 0:
            return 0
        new = (_pinned_buffers(size, need) if self.pin
               else [aligned_buffer(size, populate=True, huge=True) for _ in range(need)])
        with self._lock:
            self._free[size].extend(new)
            self.allocated += need * size
        return need

    def put(self, buf: memoryview) -> None:
        if buf.readonly:  # a file's mapped pages (``io.mapped``), not a pool buffer
            return
        with self._lock:
            if self._retired.pop(id(buf), None) is not None:
                return  # a late read may still write into it: never hand it out again
            self._free[len(buf)].append(buf)

    def retire(self, buf: memoryview) -> None:
        """Keep ``buf`` out of the pool once it is put back (a timed-out read still holds a view of it).

        The reference held here keeps ``id(buf)`` unique until ``put``; after that, the late read's own
        view keeps the memory alive until it finishes.
        """
        if buf.readonly:
            return
        with self._lock:
            self._retired[id(buf)] = buf


def _pinned_buffer(size: int) -> memoryview:
    """A 4 KiB-aligned view into page-locked memory (falls back to plain aligned memory without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return aligned_buffer(size)
    t = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=True)
    off = (-t.data_ptr()) % ALIGN
    return memoryview(t.numpy())[off : off + size]  # the array keeps the pinned tensor alive


def _pinned_buffers(size: int, count: int) -> list[memoryview]:
    """``count`` 4 KiB-aligned views of ``size`` bytes into one page-locked allocation (plain aligned memory
    without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return [aligned_buffer(size, populate=True) for _ in range(count)]
    t = torch.empty(size * count + ALIGN, dtype=torch.uint8, pin_memory=True)
    off = (-t.data_ptr()) % ALIGN
    whole = memoryview(t.numpy())  # the array keeps the pinned tensor alive
    return [whole[off + i * size : off + (i + 1) * size] for i in range(count)]


@dataclass(frozen=True, slots=True)
class ReadDeadline:
    """How long a read may take before the consumer gives up on it (retries it, then fails over).

    A read submitted behind ``ahead`` bytes on a drive of ``gbps`` is due after
    ``max(min_s, factor * (latency + (ahead + nbytes) / rate))``: ``factor`` times the time the drive
    needs at its rate for everything queued up to and including this read, and never less than ``min_s``
    (scheduler hiccups on a busy machine must not count as a failed drive).
    """

    min_s: float = 5.0
    factor: float = 10.0

    def __post_init__(self) -> None:
        if not (self.min_s > 0 and self.factor >= 1) or self.min_s == float("inf"):
            raise ValueError(f"read deadline needs min_s > 0 (finite) and factor >= 1, got {self.min_s}, {self.factor}")

    def seconds(self, nbytes: int, gbps: float, latency_s: float = 0.0) -> float:
        return max(self.min_s, self.factor * (latency_s + nbytes / (gbps * 1e9)))


@dataclass
class Completion:
    tag: object
    drive: int
    path: str
    buf: memoryview | None
    nbytes: int
    seconds: float
    error: Exception | None = None


@dataclass
class DriveCounters:
    reads: int = 0
    bytes: int = 0
    busy_seconds: float = 0.0  # summed over concurrent reads
    errors: int = 0
    active_seconds: float = 0.0  # wall time with at least one read in flight: the drive's rate is bytes / this
    check_seconds: float = 0.0  # time checking what was read (checksums), summed over the reader threads


# A read longer than this goes to the drive's reader threads as parts (each at most this size, 4 KiB-aligned, in
# order) instead of one read per file: the threads then work on the first file's parts together and it lands after
# its own bytes' time, where whole reads shared the drive among as many files as threads, and the first of them
# landed after all of theirs (8 threads of Kimi K3 experts: ~85 ms at 1.65 GB/s, at the start of every layer).
# 4 MiB is the size the drive probe reads at (``deltafin.store.drives.PROBE_READ``).
PART_BYTES = 4 << 20
MAX_PARTS = 64  # past 64 x PART_BYTES the parts grow instead (expert files are tens of MB)


@dataclass(frozen=True, slots=True)
class Checksum:
    """The xxh3-64 digest (hex, as the manifest keeps it) a read's bytes must have. The pool hashes a read part by
    part, in order, as the parts land, so the check ends one part after the last byte instead of a whole file's
    hash later; ``error(got)`` is the read's error on a mismatch."""

    expected: str
    error: Callable[[str], Exception]


class _Parts:
    """One read, in one part or several: where its bytes go, which parts are handed out, landed and hashed, the
    first error. A drive's threads take parts of the oldest reads first, at most ``cap`` threads on one read while
    other reads wait (so each read's hash chain keeps up with its parts; see ``ReaderPool._cap``)."""

    __slots__ = ("drive", "path", "nbytes", "tag", "done", "check", "starts", "step", "cap", "next", "active", "left",
                 "buf", "pooled", "error", "t0", "lock", "landed", "hashed", "hashing", "hasher")

    def __init__(self, drive: int, path: str, nbytes: int, tag: object, done: queue.SimpleQueue, check,
                 into: memoryview | None, step: int, cap: int):
        self.drive, self.path, self.nbytes, self.tag, self.done, self.check = drive, path, nbytes, tag, done, check
        self.starts = range(0, nbytes, step) or range(1)  # a read of 0 bytes is one (empty) part
        self.step, self.cap = step, cap
        self.next = 0  # parts handed out (under the drive queue's lock)
        self.active = 0  # threads on it now (under the drive queue's lock)
        self.left = len(self.starts)  # parts not yet ended
        self.buf = into
        self.pooled = into is None  # the buffer comes from the pool (and goes back there if the read fails)
        self.error: Exception | None = None
        self.t0: float | None = None  # when the first part began
        self.lock = threading.Lock()
        self.landed: set[int] = set()
        self.hashed = 0  # parts hashed, in order
        self.hashing = False  # a thread is advancing the hash chain
        self.hasher = hashing.hasher() if isinstance(check, Checksum) else None  # None: hashed whole at the end

    def part(self, i: int) -> tuple[int, int]:
        lo = self.starts[i]
        return lo, min(self.nbytes, lo + self.step)

    def buffer(self, get: Callable[[], memoryview], t0: float) -> memoryview:
        with self.lock:
            self.t0 = t0 if self.t0 is None else self.t0
            if self.error is not None:  # another part failed (its buffer, say): this one need not try again
                raise self.error
            if self.buf is None:
                self.buf = get()
            return self.buf

    def end_part(self, i: int, error: Exception | None) -> None:
        with self.lock:
            if error is not None and self.error is None:
                self.error = error
            self.left -= 1
            if error is None:
                self.landed.add(i)

    def advance_hash(self) -> None:
        """Hash the landed parts that come next in order (one thread at a time does, the others go on reading)."""
        if self.hasher is None:
            return
        with self.lock:
            if self.hashing:
                return
            self.hashing = True
        while True:
            with self.lock:
                i = self.hashed
                if self.error is not None or i >= len(self.starts) or i not in self.landed:
                    self.hashing = False
                    return
            lo, hi = self.part(i)
            self.hasher.update(self.buf[lo:hi])
            with self.lock:
                self.hashed += 1

    def finished(self) -> bool:
        """True once, for the thread that ends the read: every part ended and, with a checksum, hashed (or failed)."""
        with self.lock:
            if self.left != 0 or self.hashing:
                return False
            if self.error is None and self.hasher is not None and self.hashed < len(self.starts):
                return False
            self.left = -1  # posted
            return True


def _mapped_view(reader, path: str, nbytes: int, new: bool = True) -> memoryview | None:
    """The file's mapped pages where the reader's drive is in memory (``io.mapped``; ``new=False``: only a file
    mapped already), else None: read into a buffer."""
    maps = getattr(reader, "maps", None)
    return None if maps is None or nbytes == 0 else maps.view(path, nbytes, new=new)


@dataclass
class ReaderPool:
    """``threads`` reader threads per drive; each read fills a pooled buffer and posts a Completion."""

    readers: list[DriveReader]
    threads: int = 4
    buffers: BufferPool = field(default_factory=BufferPool)
    part_bytes: int = PART_BYTES  # reads longer than this go in parts of at most this size (0: whole reads)

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"reader threads per drive must be >= 1, got {self.threads}")
        self._exec = [_DriveQueue(self.threads, f"read-{r.label}", self._run_part) for r in self.readers]
        self.counters = [DriveCounters() for _ in self.readers]
        self._pending = [0] * len(self.readers)  # bytes submitted and not yet read, per drive
        self._inflight = [0] * len(self.readers)
        self._since = [0.0] * len(self.readers)  # when the drive last went from idle to busy
        self._hashed = [0, 0.0]  # bytes hashed by the pool, seconds it took (summed over threads)
        self._lock = threading.Lock()

    def submit(self, drive: int, path: str, nbytes: int, tag: object, done: queue.SimpleQueue,
               into: memoryview | None = None, check: Checksum | Callable[[memoryview], None] | None = None) -> int:
        """Read ``nbytes`` of ``path`` on ``drive``; a Completion with ``tag`` lands on ``done``.

        ``into`` (an aligned view of ``align_up(nbytes)`` bytes, e.g. one piece's place in a striped
        expert's buffer) receives the bytes instead of a pooled buffer. ``check``: a ``Checksum`` the bytes are
        hashed against part by part as they land, or a callable run on the whole read once it has landed; both run
        in the reader threads (overlapping the other reads) and what they raise is the read's error. Returns the
        bytes the drive had queued before this read.
        """
        with self._lock:
            ahead = self._pending[drive]
            self._pending[drive] += nbytes
        n = min(-(-nbytes // self.part_bytes), MAX_PARTS) if self.part_bytes and nbytes > self.part_bytes else 1
        step = max(align_up(-(-nbytes // n)), ALIGN)
        cap = self._cap(drive) if isinstance(check, Checksum) and hashing.streams() else self.threads
        self._exec[drive].put(_Parts(drive, path, nbytes, tag, done, check, into, step, cap))
        return ahead

    def _cap(self, drive: int) -> int:
        """Threads one checked read may take while other reads wait: as many as its hash chain (one thread at the
        hash rate) keeps up with, from this run's rates (a thread's read rate on this drive, the pool's hash rate).
        From memory (a thread copies ~3 GB/s, xxh3 hashes ~6) that is 1, and the other threads read the next
        experts; from a disk of 1.5 GB/s (8 threads share it) it is more than the parts, so a read's parts all go
        at once and it lands after its own bytes' time. Until both rates are measured there is no cap."""
        with self._lock:
            c = self.counters[drive]
            hb, hs = self._hashed
            if c.busy_seconds <= 0 or c.bytes < (64 << 20) or hs <= 0 or hb < (64 << 20):
                return self.threads
            per_thread = c.bytes / c.busy_seconds
            return max(1, min(self.threads, math.floor(hb / hs / per_thread)))

    def cancel(self, drive: int, tag: object, done: queue.SimpleQueue) -> bool:
        """Drop the read ``tag`` (answering on ``done``) on ``drive`` if no thread has started it: then no Completion
        comes. False once it has started: its Completion still lands. For reads begun on a guess
        (``StreamingExperts.guess``) that the layer turned out not to need."""
        job = self._exec[drive].cancel(tag, done)
        if job is None:
            return False
        with self._lock:
            self._pending[drive] -= job.nbytes
        return True

    def pending_bytes(self) -> list[int]:
        """Bytes each drive still has to read for earlier submissions (the scheduler's queue)."""
        with self._lock:
            return list(self._pending)

    def _run_part(self, job: _Parts, i: int) -> None:
        """Part ``i`` of a read (all of it, or one part: see PART_BYTES); the thread that ends the read (its last
        part, or its hash chain) checks it and posts its one Completion, its errors included."""
        drive = job.drive
        reader = self.readers[drive]
        lo, hi = job.part(i)
        t0 = time.perf_counter()
        with self._lock:
            self._inflight[drive] += 1
            if self._inflight[drive] == 1:
                self._since[drive] = t0
        err = None
        try:
            buf = job.buffer(lambda: _mapped_view(reader, job.path, job.nbytes)
                             or self._buffer(reader.label, job.path, job.nbytes), t0)
            if buf.readonly:  # the file's own pages, mapped (``io.mapped``): its bytes are there, nothing to read
                pass
            elif job.error is None:  # a part failed already: the read has failed, the rest is not read
                got = reader.read_into(job.path, lo, buf[lo : lo + align_up(hi - lo)])
                if got < hi - lo:
                    raise ReadError(f"drive {reader.label}: short read of {job.path}: {lo + got} of {job.nbytes} "
                                    f"bytes; run 'deltafin verify' and repack the bad experts")
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which names it
            err = e
        t1 = time.perf_counter()
        with self._lock:
            self.counters[drive].busy_seconds += t1 - t0
            self._pending[drive] -= hi - lo
            self._idle(drive, t1)
        job.end_part(i, err)
        if job.check is None:
            if job.finished():
                self._post(job, t1)
        else:
            self._check_step(job)  # hashed at once, while the part just read is in the CPU's cache

    def _check_step(self, job: _Parts) -> None:
        """After a part of ``job`` ended: hash what has landed, in order; the thread that ends the read (its hash
        chain complete, or its last part ended) checks it and posts its one Completion. Hashing on separate
        checking threads measured no faster on the H200 host from memory (16 cores), and takes more threads."""
        t0 = time.perf_counter()
        job.advance_hash()
        if not job.finished():
            self._hash_time(job, time.perf_counter() - t0)
            return
        if job.error is None and isinstance(job.check, Checksum):
            got_hex = job.hasher.hexdigest() if job.hasher is not None else xxhash.xxh3_64_hexdigest(
                job.buf[: job.nbytes])
            job.hasher = None  # its state is freed now, not when the consumer drops the read
            if got_hex != job.check.expected:
                job.error = job.check.error(got_hex)
        elif job.error is None:
            try:
                job.check(job.buf[: job.nbytes])
            except Exception as e:  # noqa: BLE001
                job.error = e
        t1 = time.perf_counter()
        self._hash_time(job, t1 - t0)
        self._post(job, t1)

    def _hash_time(self, job: _Parts, seconds: float) -> None:
        """Time this thread spent checking after its part (none when it only read)."""
        if job.check is None or seconds <= 0:
            return
        with self._lock:
            self.counters[job.drive].check_seconds += seconds

    def _post(self, job: _Parts, now: float) -> None:
        dt = now - (job.t0 or now)
        with self._lock:
            if job.error is None:
                self._count(job.drive, job.nbytes, isinstance(job.check, Checksum))
            else:
                self.counters[job.drive].errors += 1
        if job.error is not None:
            if job.pooled and job.buf is not None:
                self.buffers.put(job.buf)
            job.done.put(Completion(job.tag, job.drive, job.path, None, job.nbytes, dt, job.error))
            return
        job.done.put(Completion(job.tag, job.drive, job.path, job.buf, job.nbytes, dt))

    def mapped_now(self, drive: int, path: str, nbytes: int, count: bool = True) -> memoryview | None:
        """The first ``nbytes`` of ``path`` as its mapped pages, taken in the calling thread, where ``drive`` is in
        memory (``io.mapped``) and the file maps; None: submit a read. For reads that nothing checks on the host (the
        GPU checks them, or checks are off, or they are hashed later): such a read has nothing to do, and a hand-off
        to a reader thread and back only costs the consumer time and the interpreter lock. Only files mapped already:
        a new mapping (populating its page tables, page-locking it: 1-2 ms a K3 expert) is made by the reader
        threads, in parallel. ``count``: add it to the drive's counters (``hash_mapped`` counts it otherwise)."""
        view = _mapped_view(self.readers[drive], path, nbytes, new=False)
        if view is not None and count:
            with self._lock:
                self._count(drive, nbytes, False)
        return view

    def hash_mapped(self, drive: int, view: memoryview, nbytes: int) -> str:
        """The xxh3-64 digest (hex) of a mapped read taken with ``mapped_now(count=False)``, counted as a checked read
        of ``drive`` (its time in the drive's check seconds): for a caller that hashes it on its own threads."""
        t0 = time.perf_counter()
        got = xxhash.xxh3_64_hexdigest(view[:nbytes])
        dt = time.perf_counter() - t0
        with self._lock:
            self.counters[drive].check_seconds += dt
            self._count(drive, nbytes, True)
        return got

    def _count(self, drive: int, nbytes: int, hashed: bool) -> None:
        """A read of ``drive`` landed (called under the lock); ``hashed``: checked by the pool, which times its hash."""
        c = self.counters[drive]
        c.reads += 1
        c.bytes += nbytes
        if hashed:
            self._hashed[0] += nbytes
            self._hashed[1] = sum(x.check_seconds for x in self.counters)


    def _buffer(self, label: str, path: str, nbytes: int) -> memoryview:
        try:
            return self.buffers.get(nbytes)
        except (MemoryError, OverflowError, OSError, ValueError) as e:
            raise ReadError(f"drive {label}: cannot allocate a {nbytes:,}-byte buffer to read {path} ({e}); "
                            f"the model's manifest gives that size: run 'deltafin verify' on the model") from e

    def _idle(self, drive: int, now: float) -> None:
        """One read of ``drive`` ended (called under the lock)."""
        self._inflight[drive] -= 1
        if self._inflight[drive] == 0:
            self.counters[drive].active_seconds += now - self._since[drive]

    def close(self, wait: bool = True) -> None:
        """Stop the reader threads; ``wait=False`` when a read may hang (it is abandoned, not joined)."""
        for ex in self._exec:
            ex.shutdown(wait)


class _DriveQueue:
    """A drive's ``n`` reader threads and its queue of reads. A thread takes the next part of the oldest read
    that has fewer threads on it than its cap, else of the oldest read with parts left (never idle while a part
    waits). Daemon threads, unlike an executor's, are not joined when the interpreter exits: a read that never
    returns (a hung drive) cannot keep the process from ending after its error was reported."""

    def __init__(self, n: int, name: str, run: Callable[[_Parts, int], None]):
        self._run_part = run
        self._cv = threading.Condition()
        self._jobs: deque[_Parts] = deque()  # reads with parts not yet handed out, oldest first
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def put(self, job: _Parts) -> None:
        with self._cv:
            self._jobs.append(job)
            self._cv.notify(len(job.starts))

    def _take(self) -> tuple[_Parts, int] | None:
        with self._cv:
            while not self._jobs and not self._closed:
                self._cv.wait()
            if not self._jobs:
                return None
            job = next((j for j in self._jobs if j.active < j.cap), self._jobs[0])
            i = job.next
            job.next += 1
            job.active += 1
            if job.next == len(job.starts):
                self._jobs.remove(job)
            return job, i

    def cancel(self, tag: object, done: queue.SimpleQueue) -> _Parts | None:
        """The queued read (``tag``, ``done``), removed, if none of its parts was handed out yet; else None."""
        with self._cv:
            job = next((j for j in self._jobs if j.tag == tag and j.done is done and j.next == 0), None)
            if job is not None:
                self._jobs.remove(job)
            return job

    def _run(self) -> None:
        while (got := self._take()) is not None:
            job, i = got
            try:
                self._run_part(job, i)  # posts every outcome, its errors included, as a Completion
            finally:
                with self._cv:
                    job.active -= 1

    def shutdown(self, wait: bool = True) -> None:
        """Reads not yet started are dropped when not waiting."""
        with self._cv:
            if not wait:
                self._jobs.clear()
            self._closed = True
            self._cv.notify_all()
        if wait:
            for t in self._threads:
                t.join()
