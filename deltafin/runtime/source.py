"""The streaming expert source: routed experts read from the drives as the router asks for them.

``fetch(layer, ids)`` requests every miss the moment it is called, yields cached experts first (their
math overlaps the reads), then each miss as its read lands. Time blocked waiting for a read is I/O wait;
time between yields is expert math.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from deltafin.errors import ReadError
from deltafin.io.direct import DriveReader, FileDriveReader
from deltafin.io.pool import BufferPool, ReaderPool
from deltafin.models.base import ExpertTensors
from deltafin.runtime.cache import ExpertCache
from deltafin.store import expert_file as ef
from deltafin.store.model_dir import PackedModel


@dataclass
class SourceStats:
    io_wait_s: float = 0.0
    expert_math_s: float = 0.0
    bytes_read: int = 0
    reads: int = 0
    hits: int = 0
    misses: int = 0
    unique_bytes: set = field(default_factory=set)  # (layer, expert) keys read in the current window

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


class StreamingExperts:
    """An ExpertSource over a packed model's drives, with a RAM cache and per-drive reader threads."""

    def __init__(
        self,
        model: PackedModel,
        cache_bytes: int = 0,
        threads: int = 4,
        device: torch.device | str = "cpu",
        readers: list[DriveReader] | None = None,
        verify: bool = False,
        cache_policy: str = "lru",
    ):
        self.model = model
        self.device = torch.device(device)
        self.readers = readers or [FileDriveReader(d.label, d.path) for d in model.drives]
        pin = self.device.type == "cuda"
        self.pool = ReaderPool(self.readers, threads, BufferPool(pin=pin))
        self.cache = ExpertCache(cache_bytes, cache_policy)
        self.verify = verify
        self.stats = SourceStats()
        self.record: list[tuple[int, list[int]]] | None = None  # routing trace when recording
        self._in_copy: list = []  # (CUDA event, host buffer) pairs whose device copies may be in flight

    @property
    def direct(self) -> bool:
        return all(r.direct for r in self.readers)

    def fetch(self, layer: int, expert_ids: Sequence[int]) -> Iterator[tuple[int, ExpertTensors]]:
        if self.record is not None:
            self.record.append((layer, list(expert_ids)))
        hits, misses = [], []
        for e in expert_ids:
            got = self.cache.get((layer, e))
            (hits.append((e, got)) if got is not None else misses.append(e))
        self.stats.hits += len(hits)
        self.stats.misses += len(misses)
        done: queue.SimpleQueue = queue.SimpleQueue()
        for e in misses:
            self._submit(layer, e, 0, done)
        for e, tensors in hits:  # cached experts are computed while the misses are read
            yield from self._timed(e, tensors)
        pending = len(misses)
        while pending:
            t0 = time.perf_counter()
            c = done.get()
            self.stats.io_wait_s += time.perf_counter() - t0
            if c.error is not None:
                self._retry_or_raise(c, layer, done)
                continue
            pending -= 1
            yield from self._deliver(layer, c)

    def _submit(self, layer: int, e: int, attempt: int, done: queue.SimpleQueue) -> None:
        drive = self.model.locations(layer, e)[attempt]
        path = self.model.expert_path(layer, e, drive)
        self.pool.submit(drive, path, self.model.file_bytes(layer), (layer, e, attempt), done)

    def _retry_or_raise(self, c, layer: int, done: queue.SimpleQueue) -> None:
        _, e, attempt = c.tag
        if attempt + 1 < len(self.model.locations(layer, e)):
            self._submit(layer, e, attempt + 1, done)  # a replica on another drive serves the read
            return
        label = self.readers[c.drive].label
        if isinstance(c.error, ReadError):
            raise c.error
        raise ReadError(f"drive {label}: read of {c.path} failed: {c.error}") from c.error

    def _deliver(self, layer: int, c) -> Iterator[tuple[int, ExpertTensors]]:
        _, e, _ = c.tag
        data = c.buf[: c.nbytes]
        self.stats.bytes_read += c.nbytes
        self.stats.reads += 1
        if self.verify:
            ef.check(data, self.model.checksum(layer, e), c.path, "run 'deltafin verify' and repack the bad experts")
        tensors = ef.decode(data, where=c.path)
        if self.device.type != "cpu":
            tensors = {k: v.to(self.device, non_blocking=True) for k, v in tensors.items()}
            self._release_after_copy(c.buf)  # the host buffer is reused once its async copy is done
            self.cache.put((layer, e), tensors, c.nbytes)
        elif not self.cache.put((layer, e), tensors, c.nbytes, lambda b=c.buf: self.pool.buffers.put(b)):
            yield from self._timed(e, tensors)
            self.pool.buffers.put(c.buf)  # the consumer finished with the views: reuse the buffer
            return
        yield from self._timed(e, tensors)

    def _release_after_copy(self, buf) -> None:
        if self.device.type != "cuda":
            self.pool.buffers.put(buf)
            return
        ev = torch.cuda.Event()
        ev.record()
        self._in_copy.append((ev, buf))
        still = []
        for ev, b in self._in_copy:
            (self.pool.buffers.put(b) if ev.query() else still.append((ev, b)))
        self._in_copy = still

    def _timed(self, e: int, tensors: ExpertTensors) -> Iterator[tuple[int, ExpertTensors]]:
        t0 = time.perf_counter()
        yield e, tensors
        self.stats.expert_math_s += time.perf_counter() - t0

    def per_drive(self) -> dict[str, dict]:
        return {r.label: {"reads": c.reads, "bytes": c.bytes, "busy_s": c.busy_seconds, "errors": c.errors}
                for r, c in zip(self.readers, self.pool.counters, strict=True)}

    def close(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.pool.close()
        self.cache.clear()
