"""Reader threads per drive, reusable aligned buffers, and completions delivered as reads land.

Whatever goes wrong in a reader thread (the buffer allocation included) becomes a Completion with its
error: a consumer waiting on the completion queue always hears back, and ``ReadDeadline`` bounds how long
it waits for a read that never returns.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from deltafin.errors import ReadError
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
        return _pinned_buffer(size) if self.pin else aligned_buffer(size)

    def reserve(self, nbytes: int, count: int) -> int:
        """Have at least ``count`` free buffers of ``nbytes`` (aligned up), their pages mapped now: a read into a
        fresh buffer otherwise faults its pages in one at a time inside the read. Pinned pools are resident
        already and are left as they are. Returns the buffers added."""
        if self.pin or count <= 0:
            return 0
        size = align_up(nbytes)
        with self._lock:
            need = count - len(self._free[size])
        if need <= 0:
            return 0
        new = [aligned_buffer(size, populate=True) for _ in range(need)]
        with self._lock:
            self._free[size].extend(new)
            self.allocated += need * size
        return need

    def put(self, buf: memoryview) -> None:
        with self._lock:
            if self._retired.pop(id(buf), None) is not None:
                return  # a late read may still write into it: never hand it out again
            self._free[len(buf)].append(buf)

    def retire(self, buf: memoryview) -> None:
        """Keep ``buf`` out of the pool once it is put back (a timed-out read still holds a view of it).

        The reference held here keeps ``id(buf)`` unique until ``put``; after that, the late read's own
        view keeps the memory alive until it finishes.
        """
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


# A read longer than this goes to the drive's reader threads as parts (each at most this size, 4 KiB-aligned, in
# order) instead of one read per file: the threads then work on the first file's parts together and it lands after
# its own bytes' time, where whole reads shared the drive among as many files as threads, and the first of them
# landed after all of theirs (8 threads of Kimi K3 experts: ~85 ms at 1.65 GB/s, at the start of every layer).
# 4 MiB is the size the drive probe reads at (``deltafin.store.drives.PROBE_READ``).
PART_BYTES = 4 << 20
MAX_PARTS = 64  # past 64 x PART_BYTES the parts grow instead (expert files are tens of MB)


class _Parts:
    """One read, in one part or several: the buffer the first part takes, how many parts are still out, the first
    error."""

    def __init__(self, n: int, into: memoryview | None):
        self.left = n
        self.buf = into
        self.pooled = into is None  # the buffer comes from the pool (and goes back there if the read fails)
        self.error: Exception | None = None
        self.t0: float | None = None  # when the first part began
        self.lock = threading.Lock()

    def buffer(self, get: Callable[[], memoryview], t0: float) -> memoryview:
        with self.lock:
            self.t0 = t0 if self.t0 is None else self.t0
            if self.error is not None:  # another part failed (its buffer, say): this one need not try again
                raise self.error
            if self.buf is None:
                self.buf = get()
            return self.buf

    def finish(self, error: Exception | None) -> bool:
        """A part is done (``error``: how it failed); True for the last one."""
        with self.lock:
            if error is not None and self.error is None:
                self.error = error
            self.left -= 1
            return self.left == 0


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
        self._exec = [_Workers(self.threads, f"read-{r.label}") for r in self.readers]
        self.counters = [DriveCounters() for _ in self.readers]
        self._pending = [0] * len(self.readers)  # bytes submitted and not yet read, per drive
        self._inflight = [0] * len(self.readers)
        self._since = [0.0] * len(self.readers)  # when the drive last went from idle to busy
        self._lock = threading.Lock()

    def submit(self, drive: int, path: str, nbytes: int, tag: object, done: queue.SimpleQueue,
               into: memoryview | None = None, check: Callable[[memoryview], None] | None = None) -> int:
        """Read ``nbytes`` of ``path`` on ``drive``; a Completion with ``tag`` lands on ``done``.

        ``into`` (an aligned view of ``align_up(nbytes)`` bytes, e.g. one piece's place in a striped
        expert's buffer) receives the bytes instead of a pooled buffer. ``check(data)`` runs in the reader
        thread on the bytes read (a checksum: it overlaps the other reads); what it raises is the read's
        error. Returns the bytes the drive had queued before this read.
        """
        with self._lock:
            ahead = self._pending[drive]
            self._pending[drive] += nbytes
        n = min(-(-nbytes // self.part_bytes), MAX_PARTS) if self.part_bytes and nbytes > self.part_bytes else 1
        step = max(align_up(-(-nbytes // n)), ALIGN)
        starts = range(0, nbytes, step) or range(1)  # a read of 0 bytes is one (empty) part
        job = _Parts(len(starts), into)
        for lo in starts:
            self._exec[drive].submit(self._read, drive, path, nbytes, tag, done, check, job, lo,
                                     min(nbytes, lo + step))
        return ahead

    def pending_bytes(self) -> list[int]:
        """Bytes each drive still has to read for earlier submissions (the scheduler's queue)."""
        with self._lock:
            return list(self._pending)

    def _read(self, drive: int, path: str, nbytes: int, tag: object, done: queue.SimpleQueue,
              check: Callable[[memoryview], None] | None, job: _Parts, lo: int, hi: int) -> None:
        """Bytes [lo, hi) of a read (all of it, or one part: see PART_BYTES); the last part to end checks the whole
        read and posts its one Completion, its errors included."""
        reader = self.readers[drive]
        t0 = time.perf_counter()
        with self._lock:
            self._inflight[drive] += 1
            if self._inflight[drive] == 1:
                self._since[drive] = t0
        err = None
        try:
            buf = job.buffer(lambda: self._buffer(reader.label, path, nbytes), t0)
            if job.error is None:  # a part failed already: the read has failed, the rest is not read
                got = reader.read_into(path, lo, buf[lo : lo + align_up(hi - lo)])
                if got < hi - lo:
                    raise ReadError(f"drive {reader.label}: short read of {path}: {lo + got} of {nbytes} bytes; "
                                    f"run 'deltafin verify' and repack the bad experts")
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which names it
            err = e
        t1 = time.perf_counter()
        with self._lock:
            self.counters[drive].busy_seconds += t1 - t0
            self._pending[drive] -= hi - lo
            self._idle(drive, t1)
        if not job.finish(err):
            return
        if job.error is None and check is not None:
            try:
                check(job.buf[:nbytes])
            except Exception as e:  # noqa: BLE001
                job.error = e
        dt = time.perf_counter() - (job.t0 or t0)
        with self._lock:
            c = self.counters[drive]
            if job.error is None:
                c.reads += 1
                c.bytes += nbytes
            else:
                c.errors += 1
        if job.error is not None:
            if job.pooled and job.buf is not None:
                self.buffers.put(job.buf)
            done.put(Completion(tag, drive, path, None, nbytes, dt, job.error))
            return
        done.put(Completion(tag, drive, path, job.buf, nbytes, dt))

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


class _Workers:
    """``n`` daemon threads running submitted calls in order. Daemon threads, unlike an executor's, are not
    joined when the interpreter exits: a read that never returns (a hung drive) cannot keep the process
    from ending after its error was reported."""

    def __init__(self, n: int, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, fn, *args) -> None:
        self._q.put((fn, args))

    def _run(self) -> None:
        while (job := self._q.get()) is not None:
            job[0](*job[1])  # _read posts every outcome, its errors included, as a Completion

    def shutdown(self, wait: bool = True) -> None:
        """Queued calls not yet started are dropped when not waiting."""
        if not wait:
            while True:
                try:
                    self._q.get_nowait()
                except queue.Empty:
                    break
        for _ in self._threads:
            self._q.put(None)
        if wait:
            for t in self._threads:
                t.join()
