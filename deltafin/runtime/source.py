"""The streaming expert source: routed experts read from the drives as the router asks for them.

``fetch(layer, ids)`` queues every miss the moment it is called, yields cached experts first (their
math overlaps the reads), then each miss as its read lands. Time blocked waiting for a read is I/O wait;
time between yields is expert math. Each drive reads at most ``read_ahead`` experts ahead of the consumer
(eight per reader thread by default; a striped layer: that many experts, a piece of each on every drive): a
slow consumer holds that many read buffers, not a layer's; the source maps that many when it opens
(``reserve_buffers``), so the first prompt's reads do not fault fresh buffers in page by page.

The layer's reads go through ``deltafin.io.schedule``: it picks the copy to read for experts with
replicas (the drive that finishes the layer soonest given what each drive has queued) and orders each
drive's queue. A striped expert's pieces are read in parallel, each by its drive's reader threads, into
one aligned buffer at their offsets; the expert is delivered when its last piece lands. Every read is
checked against the expert's checksum (``verify``, on by default) and has a deadline; failures and late
reads are retried or served by a replica (``deltafin.runtime.layer_reads``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import xxhash

from deltafin.errors import ExpertFileError, UsageError
from deltafin.io import mapped as io_mapped
from deltafin.io.direct import DriveReader, FileDriveReader, align_up
from deltafin.io.pool import PART_BYTES, BufferPool, ReadDeadline, ReaderPool
from deltafin.models.base import ExpertTensors
from deltafin.runtime import host_memory
from deltafin.runtime.cache import ExpertCache
from deltafin.runtime.gpu_clock import GpuClock
from deltafin.runtime.layer_reads import LayerReads
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
    failed_reads: int = 0  # reads that failed (I/O error, short, checksum) and went to another copy or raised
    late_reads: int = 0  # reads that missed their deadline
    prefetched: int = 0  # misses read ahead of their layer (``prefetch``: routes known before the layer runs)
    guessed: int = 0  # misses read ahead on a guess of their layer's routing (``guess``)
    guess_used: int = 0  # of those, experts the layer's fetch asked for
    guess_cancelled: int = 0  # of the rest, reads cancelled before a reader thread started them
    checked_later: int = 0  # mapped reads checked while the CPU's math read them (``LaterChecked``)
    gpu_checked: int = 0  # reads checked on the GPU (``verify_on``), after they landed in their slab slots
    gpu_check_s: float = 0.0  # GPU time of those checks' launches (CUDA events)
    gpu_check_wait_s: float = 0.0  # host time from their launch to the digests in hand (the layer's copies included)
    unique_bytes: set = field(default_factory=set)  # (layer, expert) keys read in the current window

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


# Per reader thread, the experts a drive may read ahead of the consumer. A prefill layer's fetch asks for every
# expert of the layer; with a consumer slower than the drives (the CPU's math) an unbounded read-ahead holds the
# layer's every expert in read buffers: up to 1.7 GB for `bench prefill`'s 96 Kimi K3 experts a layer, 15.7 GB for
# a real Kimi K3 layer (896), which no memory budget counts. A small window costs time where the drive runs barely
# faster than the math (its dips are no longer covered by a backlog): over bench prefill's 4 layers, 2 per thread
# (16 experts at 8 threads) measured 0.3-0.5 s slower than no limit and 4 per thread about 0.1 s (time to first
# token less the math: 0.47-0.67 s against 0.34-0.49 s in 10 interleaved runs each); 8 per thread rarely binds
# there (64 of a layer's 96) and still bounds a K3 layer to 32 experts per drive at the default 4 threads.
READ_AHEAD_PER_THREAD = 8

# ``guess`` runs while a miss was seen in the last GUESS_WINDOW fetches per MoE layer (with every expert cached,
# guessing costs host time for nothing). Its guesses' misses are read only where that pays, as measured over the last
# GUESS_WINDOW guesses per MoE layer (at least GUESS_MIN_SAMPLE misses named):
# - at least GUESS_MIN_USEFUL of the misses they named were asked for, and
# - the drive time their unused reads would take is at most what the drives sat idle between a layer's reads and the
#   next's (the gap a guess fills), measured on layers not read ahead.
# Until then a guess is only scored against what its layer asks for, unread: each one while there are too few, one
# in GUESS_PROBE while they do not pay; and while they are read, one in GUESS_PROBE is scored unread, to go on
# measuring the gap. Measured on bench peer's random Qwen3-MoE (2-core VM, a 0.86 GB/s disk):
# - with a 0.5 GB cache ~6-29% of the guessed misses were asked for (the cache holds the experts routing
#   favours; the misses are the rare ones): reading them slowed decode from 25.7 to 21.2 tok/s;
# - with no cache 57% were, but the wasted reads took as much drive time as the gaps they filled: 4.8 against 5.2
#   tok/s (medians of six alternated runs), the I/O wait down from 1.1-1.4 s to 0.6-1.2 s.
GUESS_WINDOW = 2
GUESS_MIN_USEFUL = 0.5
GUESS_MIN_SAMPLE = 16
GUESS_PROBE = 8


class StreamingExperts:
    """An ExpertSource over a packed model's drives, with a RAM cache and per-drive reader threads."""

    def __init__(
        self,
        model: PackedModel,
        cache_bytes: int = 0,
        threads: int = 4,
        device: torch.device | str = "cpu",
        readers: list[DriveReader] | None = None,
        verify: bool = True,
        cache_policy: str = "lru",
        deadline: ReadDeadline | None = None,
        read_ahead: int | None = None,
        reserve: bool = True,
        verify_on: str = "auto",
        guess_next: bool = True,
        map_files: bool | None = None,
    ):
        self.model = model
        self.guess_next = guess_next  # read a layer's likely experts ahead (``guess``) while misses are seen
        # experts a drive reads ahead of the consumer (0: a layer's whole fetch at once); see LayerReads
        self.read_ahead = READ_AHEAD_PER_THREAD * threads if read_ahead is None else read_ahead
        self.device = torch.device(device)
        self.readers = readers or [FileDriveReader(d.label, d.path) for d in model.drives]
        assert len(self.readers) == len(model.drives), "one reader per model drive"
        mapping = io_mapped.MAP_FILES if map_files is None else map_files  # drives in memory: files mapped
        self.mapped = _map_in_memory(self.readers, torch.device(device)) if mapping else []
        # what the scheduler knows of each drive: the emulated model when there is one, else the manifest
        models = [getattr(r, "model", None) for r in self.readers]
        self._rates = [m.gbps if m is not None else d.gbps for m, d in zip(models, model.drives, strict=True)]
        self._latency = [m.lat_us * 1e-6 if m is not None else 0.0 for m in models]
        pin = self.device.type == "cuda"
        self.pool = ReaderPool(self.readers, threads, BufferPool(pin=pin), part_bytes=self._part_bytes(threads))
        self.cache = ExpertCache(cache_bytes, cache_policy)
        self.verify = verify
        self.gpu_checks = verify and _gpu_checks(verify_on, self.device)  # whole reads checked in their slab slots
        self.deadline = deadline or ReadDeadline()
        from deltafin.store.verify import repair_hint

        self.repair_fix = f"re-run '{repair_hint(model)}' to rewrite the bad expert files"
        self.stats = SourceStats()
        self.clock = GpuClock(self.device) if self.device.type == "cuda" else None  # CUDA: times on the GPU's clock
        self.record: list[tuple[int, list[int]]] | None = None  # (layer, ids) per fetch when a list
        self.routes: list[tuple[int, list[int]]] | None = None  # the same, for the routing-trace recorder
        self._in_copy: list = []  # (CUDA event, host buffer) pairs whose device copies may be in flight
        # CUDA: one slab of fixed-size expert slots (deltafin.kernels.triton_moe.ExpertSlab) that reads land in;
        # the first cache_bytes // expert bytes slots are the cache, the rest a scratch ring for uncached reads
        self.slab = None
        self._slab_cache_slots = 0
        self._free: list[int] = []
        self._slot_of: dict = {}  # cache key -> slot
        self._in_slab: dict[int, int] = {}  # layer -> its experts cached in slab slots
        self._resident: dict[int, torch.Tensor] = {}  # layer -> its slot table, once resident for good
        self._holds_all = False  # the slab's cache slots hold every expert of the model: none is ever evicted
        self._busy: set[int] = set()  # slots handed out since this fetch began (a launch may still read them)
        self._scratch_next = 0
        self.reserved = (0, 0, 0.0)  # (buffers, bytes, seconds) mapped when the source opened
        self._ahead: dict[int, tuple[list[int], LayerReads, bool]] = {}  # layer -> misses read ahead, reads, guessed
        self._guess: tuple | None = None  # (layer, ids, read) to read ahead (or score) once the next fetch has queued
        self._stale: list[LayerReads] = []  # narrowed reads whose unwanted experts are still in flight
        self._miss_log: deque[int] = deque(maxlen=GUESS_WINDOW * max(len(model.moe_layers), 1))  # misses a fetch
        self._recent_misses = 0
        self._guess_log: deque[tuple[int, int]] = deque(maxlen=self._miss_log.maxlen)  # (misses, asked for) a guess
        self._guess_sums = [0, 0]  # the log's misses and asked-for, summed (asked every layer: kept, not recounted)
        self._expert_bytes = max((model.file_bytes(L) for L in model.moe_layers), default=0)
        self._guess_turn = 0  # turns offered while the guesses score low (GUESS_PROBE)
        self._scored: dict[int, list[int]] = {}  # layer -> a guess's misses, scored at its fetch but not read
        self._gaps: deque[float] = deque(maxlen=self._miss_log.maxlen)  # drives idle before a layer's own reads, s
        self._last_landed: float | None = None  # when the last fetch's last read landed
        self._starts = 0  # guesses started while their reads pay (one in GUESS_PROBE is scored unread)
        self._hashers: ThreadPoolExecutor | None = None  # ``check_threads``, made at the first LaterChecked group
        if reserve:
            self.reserve_buffers()

    # A drive whose threads' reads of whole experts take longer than this to land the first one reads in parts
    FIRST_LANDS_S = 0.02

    def _part_bytes(self, threads: int) -> int:
        """Whole reads, or parts (``io.pool.PART_BYTES``) where the first expert of a layer would land late. CUDA
        reads whole: a layer's grouped launch waits for all of its experts, so the order they land in does not
        matter, and parts cost hand-offs (on the H200 host from memory, 16 cores: checked whole reads 12-17 GB/s,
        4 MiB parts 7-11). The CPU computes each expert as it lands: on a drive whose threads, reading whole
        experts at once, would land the first after more than ``FIRST_LANDS_S`` (8 Kimi K3 experts at 1.65 GB/s:
        85 ms), parts let it land after its own bytes' time; on fast drives whole reads again."""
        m = self.model
        if self.device.type == "cuda" or not m.moe_layers:
            return 0
        nbytes = max(m.file_bytes(L) for L in m.moe_layers)
        slow = min(self._rates) * 1e9 < threads * nbytes / self.FIRST_LANDS_S
        return PART_BYTES if slow else 0

    def reserve_buffers(self) -> tuple[int, int, float]:
        """Map, now, as many read buffers as the bounded read-ahead can hold at once (a lane per drive, or one
        for striped layers, ``read_ahead`` experts each, and the one the consumer holds), of the model's expert
        file size, and keep them in the pool. The source opens with the model, so this is load time: without it
        the first prompt's reads fault every 4 KiB page of each new buffer in, inside the reads and beside the
        math (`bench prefill` on a 2-core VM: 0.5-5.9 s of system time a run with fresh buffers, 0.2-0.3 s with its
        65 Kimi K3-size buffers, 1.14 GB, mapped at open, which took 0.3-0.8 s).
        Nothing is reserved with an unbounded read-ahead (0), for pinned (CUDA) pools, or past an eighth of the
        memory available. On CUDA they are page-locked (one allocation), so each lands in its slab slot by DMA,
        with room for the copies still in flight (``SCRATCH_SLOTS``). Returns and records (buffers, bytes,
        seconds)."""
        m = self.model
        layers = m.moe_layers
        if not layers or not self.read_ahead or len(self.mapped) == len(self.readers):  # mapped: no read buffers
            return self.reserved
        sizes = Counter(m.file_bytes(L) for L in layers)
        nbytes = max(sizes, key=lambda n: (sizes[n], n))  # the common size (every layer's, in the usual model)
        own = sum(getattr(r, "reads", True) for r in self.readers)  # a cluster rank reads its own drives only
        lanes = min(1, own) if all(m.stripe(L) is not None for L in layers) else own
        count = lanes * min(self.read_ahead, m.num_experts) + 1
        if self.pool.buffers.pin:
            count += min(self.SCRATCH_SLOTS, m.num_experts)  # read while earlier ones still copy to the device
        count = min(count, host_memory.available_bytes() // 8 // align_up(nbytes))
        t0 = time.perf_counter()
        added = self.pool.buffers.reserve(nbytes, count)
        self.reserved = (added, added * align_up(nbytes), time.perf_counter() - t0)
        return self.reserved

    def premap(self) -> tuple[int, float]:
        """Map (and on CUDA page-lock) now every expert file on the drives in memory, up to each drive's mapping
        limit, rather than at each file's first read: load time, as ``reserve_buffers`` is for read buffers.
        Returns (files mapped, seconds)."""
        t0, n = time.perf_counter(), 0
        by_drive = {self.readers.index(r): r.maps for r in self.mapped}
        for L in self.model.moe_layers:
            if self.model.stripe(L) is not None:
                continue
            for e in range(self.model.num_experts):
                for d in self.model.locations(L, e):
                    maps = by_drive.get(d)
                    if maps is not None and maps.view(self.model.expert_path(L, e, d), 1) is not None:
                        n += 1
        return n, time.perf_counter() - t0

    @property
    def direct(self) -> bool:
        return all(r.direct for r in self.readers)

    def fetch(self, layer: int, expert_ids: Sequence[int]) -> Iterator[tuple[int, ExpertTensors]]:
        return self._fetch(layer, expert_ids, False)

    def fetch_groups(self, layer: int, expert_ids: Sequence[int], checks_later: bool = False
                     ) -> Iterator[list[tuple[int, ExpertTensors]]]:
        """``fetch`` in groups (see ``models.base.ExpertSource``): the cached experts first, as one list (the cache
        keeps them: nothing is put in it, and so nothing evicted, before the next list is asked for), then each
        expert read from a drive alone (its buffer goes back to the reads once the next list is asked for).
        ``checks_later`` (where ``checks_later_ok``): the files mapped from drives in memory come as one more list,
        not yet checked, a ``LaterChecked``: the consumer computes them while ``check_threads`` hash them, then
        calls its ``settle()`` before using the results, and computes again the experts it returns."""
        return self._fetch(layer, expert_ids, True, checks_later and self.checks_later_ok)

    def check_threads(self) -> ThreadPoolExecutor:
        """The threads that hash mapped files beside the CPU's math (``LaterChecked``): as many as reads in flight,
        at most half the cores. On the H200 host (16 cores, K3-size files in memory, `bench ingest --device cpu`)
        full decode ran 0.96 / 1.04 of raw with 4 / 8 threads hashing beside the math, 0.67 with 16 (past half the
        cores the hashing threads and the math's take turns on the same cores); capped at 8, 0.76 at 16 in flight."""
        if self._hashers is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
            self._hashers = ThreadPoolExecutor(max(1, min(self.pool.threads, cores // 2)), "check")
        return self._hashers

    @property
    def checks_later_ok(self) -> bool:
        """Whether ``fetch_groups(..., checks_later=True)`` can hand over unchecked mapped files: on the CPU, reads
        checked on the host, some drive in memory. There a read is only its check (nothing is copied), and checking
        it while the math reads it overlaps the two passes over the bytes that otherwise run one after the other."""
        return self.device.type == "cpu" and self.verify and bool(self.mapped)

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None:
        """Start reading now the misses among ``expert_ids`` of a layer whose routing is known before it runs
        (DeepSeek-V4's hash-routed layers: the experts follow from the token ids); that layer's next fetch takes
        them as they land, so their reads overlap the layers before it."""
        if layer in self._ahead:
            return
        misses = [e for e in dict.fromkeys(expert_ids) if (layer, e) not in self.cache]
        if misses:
            self._ahead[layer] = (misses, LayerReads(self, layer, misses), False)
            self.stats.prefetched += len(misses)

    def wants_guess(self, layer: int) -> bool:
        """Whether to guess ``layer``'s experts now (before the guess's routing is computed): on (``guess_next``), a
        miss among the last fetches, nothing read ahead for it yet, and, while reading the guesses would not pay
        (``guess_reads``), one turn in GUESS_PROBE."""
        if not self.guess_next or self._recent_misses == 0 or layer in self._ahead:
            return False
        if self.guess_reads or self._guess_sample < GUESS_MIN_SAMPLE:
            return True
        self._guess_turn += 1
        return self._guess_turn % GUESS_PROBE == 0

    def _log_guess(self, named: int, asked: int) -> None:
        if len(self._guess_log) == self._guess_log.maxlen:
            n, u = self._guess_log[0]
            self._guess_sums[0] -= n
            self._guess_sums[1] -= u
        self._guess_log.append((named, asked))
        self._guess_sums[0] += named
        self._guess_sums[1] += asked

    @property
    def _guess_sample(self) -> int:
        return self._guess_sums[0]

    @property
    def guess_useful(self) -> float:
        """The share of the misses the last guesses named that their layers asked for (0.0 before any)."""
        n, u = self._guess_sums
        return u / n if n else 0.0

    @property
    def guess_note(self) -> str:
        """Why guesses are not read, for the stats line ("" where they are, or none was made)."""
        if not self._guess_sample or self.guess_reads:
            return ""
        gap = self.guess_gap_s
        idle = "no layer's own reads measured yet" if gap is None else f"{gap * 1e3:.1f} ms the drives sat idle"
        return (f"next-layer guesses not read: {self.guess_useful:.0%} of their misses were asked for (reading needs "
                f"{GUESS_MIN_USEFUL:.0%}); their unused reads would take {self.guess_waste_s * 1e3:.1f} ms of drive "
                f"time a layer, against {idle} before a layer's reads")

    @property
    def guess_waste_s(self) -> float:
        """The drive time the unused reads of a guess take, on average over the last guesses (the drives' rates
        summed)."""
        if not self._guess_log:
            return 0.0
        unused = (self._guess_sums[0] - self._guess_sums[1]) / len(self._guess_log)
        return unused * self._expert_bytes / (max(sum(self._rates), 1e-3) * 1e9)

    @property
    def guess_gap_s(self) -> float | None:
        """How long the drives sat idle before a layer's own reads, on average over the last layers not read ahead
        (None before any)."""
        return sum(self._gaps) / len(self._gaps) if self._gaps else None

    @property
    def guess_reads(self) -> bool:
        """Whether a guess's misses are read (else only scored): over enough of them, the last guesses named mostly
        experts their layers asked for, and their unused reads take no more drive time than the gaps they fill."""
        gap = self.guess_gap_s
        return (self._guess_sample >= GUESS_MIN_SAMPLE and self.guess_useful >= GUESS_MIN_USEFUL
                and gap is not None and self.guess_waste_s <= gap)

    def guess(self, layer: int, expert_ids: Sequence[int], read: bool | None = None) -> None:
        """A guess of a coming layer's experts (``models.common.DecoderLM.guess_experts``: its router on an earlier
        layer's stream). Where reading the last guesses paid (``guess_reads``) its misses are read once the next
        fetch (the layer before it) has queued its own, so they land while that layer computes; the layer's fetch
        takes those it asks for, and the others' reads are cancelled or skipped (``LayerReads.narrow``). Otherwise
        it is only scored against what the layer asks for. What is computed does not change, only when reads
        start. Callers ask ``wants_guess`` first. ``read``: read (True) or only score (False) whatever the scores
        (``bench ingest --guess``)."""
        if self.guess_next and layer not in self._ahead:
            self._guess = (layer, list(expert_ids), read)

    def _start_guess(self) -> None:
        got, self._guess = self._guess, None
        if got is None or got[0] in self._ahead:
            return
        layer, ids, read = got
        misses = [e for e in dict.fromkeys(ids) if (layer, e) not in self.cache]
        if not misses:
            return
        if read is None:
            read = self.guess_reads
            if read:
                self._starts += 1
                read = self._starts % GUESS_PROBE != 0  # one in GUESS_PROBE scored unread: the gap stays measured
        if not read:
            self._scored[layer] = misses
            return
        self._ahead[layer] = (misses, LayerReads(self, layer, misses), True)
        self.stats.guessed += len(misses)

    def _take_ahead(self, layer: int, expert_ids: Sequence[int]) -> tuple[list[int], LayerReads | None]:
        """The reads ``prefetch`` or ``guess`` started for this layer that the fetch asks for, and their reads; the
        reads of the others are cancelled or left to land unseen (a fetch never yields an expert it did not ask
        for)."""
        self._stale = [r for r in self._stale if not r.poll()]
        wanted = set(expert_ids)
        scored = self._scored.pop(layer, None)
        if scored is not None:
            self._log_guess(len(scored), len(wanted.intersection(scored)))
        misses, reads, guessed = self._ahead.pop(layer, ([], None, False))
        if reads is None:
            return [], None
        early = [e for e in misses if e in wanted]
        cancelled = reads.narrow(wanted)
        if guessed:
            self.stats.guess_used += len(early)
            self.stats.guess_cancelled += cancelled
            self._log_guess(len(misses), len(early))
        return early, reads

    def _fetch(self, layer: int, expert_ids: Sequence[int], grouped: bool, later: bool = False) -> Iterator:
        for log in (self.record, self.routes):
            if log is not None:
                log.append((layer, list(expert_ids)))
        self._busy = set()
        early, early_reads = self._take_ahead(layer, expert_ids)
        hits, misses = [], []
        for e in expert_ids:
            if e in early:
                continue
            got = self.cache.get((layer, e))
            (hits.append((e, got)) if got is not None else misses.append(e))
        self.stats.hits += len(hits)
        self.stats.misses += len(misses) + len(early)
        self._note_misses(len(misses) + len(early))
        if misses and not early and self._last_landed is not None and not any(self.pool.pending_bytes()):
            self._gaps.append(time.perf_counter() - self._last_landed)  # the drives idle since the last read landed
        reads = LayerReads(self, layer, misses, checks_later=later) if misses else None
        if self._guess is not None:
            self._start_guess()  # behind this layer's own reads on every drive
        if self.slab is not None:
            self._busy.update(self._slot_of[(layer, e)] for e, _ in hits if (layer, e) in self._slot_of)
        if grouped and hits:  # cached experts are computed while the misses are read
            t0, span = time.perf_counter(), self.clock and self.clock.start()
            yield hits
            self._math_done(t0, span)
        elif hits:
            for e, tensors in hits:
                yield from self._timed(e, tensors)
        # GPU checks: the layer's landed experts are held until one pair of launches has checked them all in their slots
        checks = [] if self.gpu_checks and self.model.stripe(layer) is None else None
        held, unchecked = [], []
        for source, n in ((early_reads, len(early)), (reads, len(misses))):
            for _ in range(n):
                t0, ev = time.perf_counter(), self.clock and self.clock.mark()
                landed = source.next()
                self._last_landed = time.perf_counter()
                if self.clock is None:
                    self.stats.io_wait_s += time.perf_counter() - t0
                else:
                    self.clock.waited(t0, time.perf_counter(), ev)
                if checks is not None:
                    held.append((landed[0], self._place(layer, *landed, source, checks)))
                    continue
                if source is reads and landed[0] in reads.unchecked:
                    unchecked.append(landed)
                    continue
                for item in self._deliver(layer, *landed):
                    yield [item] if grouped else item
        if unchecked:
            group = LaterChecked(self, layer, unchecked, reads)
            t0 = time.perf_counter()
            yield group
            assert group.settled, "a LaterChecked group was used without settle()"
            self.stats.expert_math_s += time.perf_counter() - t0 - group.wait_s  # the wait is I/O's (settle)
            group.release()
        if early_reads is not None and early_reads.in_flight:
            self._stale.append(early_reads)  # unwanted experts still being read: polled at the next fetches
        if checks:
            self._check_on_gpu(layer, checks)
        for e, tensors in held:
            for item in self._timed(e, tensors):
                yield [item] if grouped else item

    def _note_misses(self, n: int) -> None:
        if len(self._miss_log) == self._miss_log.maxlen:
            self._recent_misses -= self._miss_log[0]
        self._miss_log.append(n)
        self._recent_misses += n

    def _deliver(self, layer: int, e: int, buf: memoryview, nbytes: int, where: str
                 ) -> Iterator[tuple[int, ExpertTensors]]:
        if self.device.type != "cpu":
            yield from self._timed(e, self._to_device(layer, e, buf, nbytes, where))
            return
        data = buf[:nbytes]
        self.stats.bytes_read += nbytes
        self.stats.reads += 1
        layout, _, _ = ef.parse_header(data, where)
        tensors = ef.decode(data, layout, where)
        if not self.cache.put((layer, e), tensors, nbytes, lambda b=buf: self.pool.buffers.put(b)):
            yield from self._timed(e, tensors)
            self.pool.buffers.put(buf)  # the consumer finished with the views: reuse the buffer
            return
        yield from self._timed(e, tensors)

    def _to_device(self, layer: int, e: int, buf: memoryview, nbytes: int, where: str,
                   slot: tuple[int | None, bool] | None = None, parsed: tuple | None = None) -> ExpertTensors:
        """A landed (checked) expert on the device: into a slab slot (``slot``, else one taken now) where the slab
        takes it, else tensor by tensor; the host buffer is reused once its asynchronous copy is done. ``parsed``:
        (layout, host tensors) of these bytes, already parsed."""
        data = buf[:nbytes]
        self.stats.bytes_read += nbytes
        self.stats.reads += 1
        if parsed is None:
            layout, _, _ = ef.parse_header(data, where)
            parsed = layout, ef.decode(data, layout, where)
        layout, tensors = parsed
        if self.device.type == "cuda" and (slot is not None or self._slab_ready(tensors, nbytes, layout)):
            tensors = self._to_slot(layer, e, tensors, nbytes, data, slot)
        else:
            tensors = {k: v.to(self.device, non_blocking=True) for k, v in tensors.items()}
            self.cache.put((layer, e), tensors, nbytes)
        self._release_after_copy(buf)
        return tensors

    def _place(self, layer: int, e: int, buf: memoryview, nbytes: int, where: str, reads: LayerReads,
               checks: list) -> ExpertTensors:
        """An expert read unchecked, for the GPU check: into a slab slot, noted in ``checks`` (slot, bytes, name,
        reads) for ``_check_on_gpu``. One that takes no slot (not of the slab's layout, every slot in use, a header
        that does not parse) is checked here on the host first, as the reader threads would have."""
        data = buf[:nbytes]
        parsed = None
        try:
            layout, _, _ = ef.parse_header(data, where)
            parsed = layout, ef.decode(data, layout, where)
            fits = self._slab_ready(parsed[1], nbytes, layout)
        except ExpertFileError:
            fits = False
        if not fits and self.slab is None:  # experts of no slab format: the reader threads check them from now on
            self.gpu_checks = False
        slot = self._take_slot() if fits else (None, False)
        if slot[0] is None:
            return self._to_device(layer, e, *self._host_checked(layer, e, buf, nbytes, where, reads))
        checks.append((e, slot[0], nbytes, where, reads))
        return self._to_device(layer, e, buf, nbytes, where, slot, parsed)

    def _host_checked(self, layer: int, e: int, buf: memoryview, nbytes: int, where: str, reads: LayerReads
                      ) -> tuple[memoryview, int, str]:
        """(buffer, bytes, name) of a copy of the expert whose bytes match its checksum: this one, hashed here, or
        on a mismatch the next copy that does (``LayerReads.reread``: failover, or the mismatch's error)."""
        expected = self.model.checksum(layer, e)
        got = xxhash.xxh3_64_hexdigest(buf[:nbytes])
        if got == expected:
            return buf, nbytes, where
        self.pool.buffers.put(buf)
        return reads.reread(e, ef.checksum_error(where, expected, got, self.repair_fix))

    def _check_on_gpu(self, layer: int, checks: list) -> None:
        """Check the layer's experts that landed unchecked, in their slab slots, in one pair of launches, before any math
        reads them. The host waits here for the layer's copies (which the grouped launch needs anyway), the
        launch and 64 bytes an expert; timed in ``stats``. A mismatch reads the expert's next copy (checked on the
        host) into the same slot, so the views already handed out stay valid; with no copy left it is dropped
        from the cache and the mismatch's error raised, as a mismatch found by the reader threads would be."""
        from deltafin import kernels

        slots, lengths = [c[1] for c in checks], [c[2] for c in checks]
        t0 = time.perf_counter()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        got = kernels.xxh3_64_rows(self.slab.bytes, slots, lengths, ev1.record)
        if got is None:  # the kernel failed to build here (logged): the slots' bytes are hashed on the host
            got = [xxhash.xxh3_64_intdigest(self.slab.bytes[s, :n].cpu().numpy()) for s, n in zip(slots, lengths,
                                                                                                  strict=True)]
            ev1.record()
        self.stats.gpu_check_wait_s += time.perf_counter() - t0
        self.stats.gpu_check_s += ev0.elapsed_time(ev1) / 1e3 if ev1.query() else 0.0
        self.stats.gpu_checked += len(checks)
        for (e, slot, _, where, reads), digest in zip(checks, got, strict=True):
            expected = self.model.checksum(layer, e)
            if f"{digest:016x}" == expected:
                continue
            err = ef.checksum_error(where, expected, f"{digest:016x}", self.repair_fix)
            try:
                buf, n, _ = reads.reread(e, err)
            except Exception:
                if (layer, e) in self._slot_of:
                    self.cache.evict((layer, e))  # never served from the cache with bytes that failed their check
                raise
            self.slab.write_file(slot, ef.byte_tensor(buf[:n], n))
            self._release_after_copy(buf)

    @property
    def checks_where(self) -> str:
        """Where reads are checked: "gpu" (in their slab slots; striped layers and experts outside the slab on the
        host), "host" (the reader threads) or "off"."""
        return "gpu" if self.gpu_checks else "host" if self.verify else "off"

    SCRATCH_SLOTS = 64

    def _slab_ready(self, tensors: dict, nbytes: int, layout) -> bool:
        """True when ``tensors`` go into the slab (created at the first expert of a kernel format, as whole
        files of its ``layout``: one host-to-device copy an expert)."""
        from deltafin.kernels.triton_moe import MOE_FORMATS, ExpertSlab

        if self.slab is None:
            if set(tensors) != set(ExpertSlab.ROLES) or any(
                    getattr(t, "format", None) not in MOE_FORMATS for t in tensors.values()):
                return False
            # the cache budget in slots, but never past what the device can hold beside the scratch ring
            # nor past every expert of the model: a cache that holds them all needs no more slots
            slots = min(self.cache.budget // nbytes, len(self.model.moe_layers) * self.model.num_experts)
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                slots = min(slots, max(int(free - (2 << 30)) // nbytes - self.SCRATCH_SLOTS, 0))
            self._slab_cache_slots = slots
            self._holds_all = slots >= len(self.model.moe_layers) * self.model.num_experts
            self.slab = ExpertSlab(self._slab_cache_slots + self.SCRATCH_SLOTS, tensors, self.device, layout)
            self._free = list(range(self._slab_cache_slots))
        return self.slab.layout == layout and self.slab.fits(tensors)

    def _take_slot(self) -> tuple[int | None, bool]:
        """(slot, cached): a free cache slot (evicting the least recent expert not in use by this layer),
        else a scratch slot not in use, else (None, False)."""
        if not self._free and self._slab_cache_slots:
            key = self.cache.victim()
            if key is not None and self._slot_of.get(key) not in self._busy:
                self.cache.evict(key)
        if self._free:
            return self._free.pop(), True
        for _ in range(self.SCRATCH_SLOTS):
            s = self._slab_cache_slots + self._scratch_next
            self._scratch_next = (self._scratch_next + 1) % self.SCRATCH_SLOTS
            if s not in self._busy:
                return s, False
        return None, False

    def _to_slot(self, layer: int, e: int, tensors: dict, nbytes: int, data: memoryview,
                 taken: tuple[int | None, bool] | None = None) -> dict:
        slot, cached = self._take_slot() if taken is None else taken
        if slot is None:  # every slot is in use by this layer: a plain device copy
            return {k: v.to(self.device, non_blocking=True) for k, v in tensors.items()}
        # the whole file in one copy, stream-ordered after any launch that read the slot before
        self.slab.write_file(slot, ef.byte_tensor(data, nbytes))
        views = self.slab.views(slot)
        self._busy.add(slot)
        if cached:
            self._slot_of[(layer, e)] = slot
            self._in_slab[layer] = self._in_slab.get(layer, 0) + 1
            self.cache.put((layer, e), views, nbytes, lambda k=(layer, e), s=slot: self._slot_freed(k, s))
        return views

    def _slot_freed(self, key, slot: int) -> None:
        if self._slot_of.pop(key, None) is not None:
            self._in_slab[key[0]] -= 1
            self._resident.pop(key[0], None)
        self._free.append(slot)

    def resident_slots(self, layer: int) -> torch.Tensor | None:
        """The slab slot of each of ``layer``'s experts ([E] int32 on the device) once every one is cached there
        for good: the slab's cache slots hold every expert of the model, so none is ever evicted. Else None
        (also while fetches are logged: the decode runner then looks slots up on the device and never tells the
        host which experts it used)."""
        if not self._holds_all or self.record is not None or self.routes is not None:
            return None
        t = self._resident.get(layer)
        if t is None and self._in_slab.get(layer, 0) == self.model.num_experts:
            slots = [self._slot_of[(layer, e)] for e in range(self.model.num_experts)]
            t = self._resident[layer] = torch.tensor(slots, dtype=torch.int32).to(self.device)
        return t

    def served_resident(self, layer: int, n: int) -> None:
        """Count ``n`` experts of a resident layer served from the slab without a fetch (all hits)."""
        self.stats.hits += n
        self.cache.hits += n
        self._note_misses(0)

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
        t0, span = time.perf_counter(), self.clock and self.clock.start()
        yield e, tensors
        self._math_done(t0, span)

    def _math_done(self, t0: float, span) -> None:
        if self.clock is None:
            self.stats.expert_math_s += time.perf_counter() - t0
        else:
            self.clock.end(span)

    @contextlib.contextmanager
    def math_span(self):
        """Expert math launched after the fetch (the grouped kernels, once every expert has arrived)."""
        t0, span = time.perf_counter(), self.clock and self.clock.start()
        try:
            yield
        finally:
            self._math_done(t0, span)

    def settle_clock(self) -> None:
        """CUDA: resolve the GPU-clock times (expert math, waits on reads that left the GPU idle) into ``stats``;
        synchronises the device, so call it between steps, not inside one."""
        if self.clock is None:
            return
        m0, i0 = self.clock.math_s, self.clock.idle_s
        m, i = self.clock.settle()
        self.stats.expert_math_s += m - m0
        self.stats.io_wait_s += i - i0

    def per_drive(self) -> dict[str, dict]:
        return {r.label: {"reads": c.reads, "bytes": c.bytes, "busy_s": c.busy_seconds, "errors": c.errors,
                          "active_s": c.active_seconds, "check_s": c.check_seconds}
                for r, c in zip(self.readers, self.pool.counters, strict=True)}

    def close(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self._ahead.clear()
        self._scored.clear()
        self._stale.clear()
        self.pool.close(wait=not self.stats.late_reads)  # a read that missed its deadline may never return
        if self._hashers is not None:
            self._hashers.shutdown(wait=True)
            self._hashers = None
        self.cache.clear()
        for r in self.mapped:
            r.maps.close()


class LaterChecked(list):
    """Experts of one layer mapped from drives in memory and handed over before their check (``fetch_groups``'s
    ``checks_later``): a list of (expert id, tensors) whose bytes ``check_threads`` are hashing meanwhile. The
    consumer may compute with them but uses no result before ``settle()``, which waits for the checks and returns
    (expert id, tensors) of a good copy for each expert whose bytes failed theirs (read from a replica and
    checked, or the mismatch's error raised as a checked read's would be): the consumer computes those again.
    Only checked experts go into the cache."""

    def __init__(self, src: StreamingExperts, layer: int, landed: list, reads: LayerReads):
        self.src, self.layer, self.reads = src, layer, reads
        self.settled = False
        self.wait_s = 0.0  # time settle() waited for checks still running
        self._held: list = []  # buffers of good copies read after a mismatch, given back at ``release``
        self._mapped: dict[int, tuple] = {}  # expert -> (view, bytes, tensors, name, its check's future or None)
        items = []
        hashers = src.check_threads()
        for e, buf, nbytes, where in landed:
            hashed = hashers.submit(src.pool.hash_mapped, reads.came_from[e], buf, nbytes)
            src.stats.bytes_read += nbytes
            src.stats.reads += 1
            src.stats.checked_later += 1
            try:
                tensors = ef.decode(buf[:nbytes], where=where)
            except ExpertFileError as bad:  # a header that does not parse: its check says whether the copy is bad
                buf, nbytes, where = self._good_copy(e, hashed.result(), where, bad)
                tensors, hashed = ef.decode(buf[:nbytes], where=where), None
            self._mapped[e] = (buf, nbytes, tensors, where, hashed)
            items.append((e, tensors))
        super().__init__(items)

    def _good_copy(self, e: int, got: str, where: str, bad: Exception | None = None) -> tuple[memoryview, int, str]:
        """(buffer, bytes, name) of a checked copy of expert ``e``, whose mapped copy hashed to ``got``: read from
        its replica where that copy fails its checksum (``LayerReads.reread``: the mismatch's error with none left).
        ``bad``: the copy's header did not parse; raised as it is if the copy matches its checksum after all."""
        src = self.src
        expected = src.model.checksum(self.layer, e)
        if got == expected and bad is not None:
            raise bad
        src.stats.failed_reads += 1
        return self.reads.reread(e, ef.checksum_error(where, expected, got, src.repair_fix))

    def settle(self) -> list[tuple[int, ExpertTensors]]:
        """Wait for every expert's check; returns (expert, tensors of a checked copy) for those that failed."""
        if self.settled:
            return []
        redo, src = [], self.src
        for e, (buf, nbytes, tensors, where, hashed) in self._mapped.items():
            t0 = time.perf_counter()
            got = hashed.result() if hashed is not None else None  # None: a checked copy already
            self.wait_s += time.perf_counter() - t0
            if got is not None and got != src.model.checksum(self.layer, e):
                buf, nbytes, where = self._good_copy(e, got, where)
                tensors = ef.decode(buf[:nbytes], where=where)
                redo.append((e, tensors))
            if not src.cache.put((self.layer, e), tensors, nbytes, lambda b=buf: src.pool.buffers.put(b)):
                self._held.append(buf)
        self.settled = True
        src.stats.io_wait_s += self.wait_s
        return redo

    def release(self) -> None:
        """The consumer is done with the group: read buffers of uncached experts go back to the reads."""
        for b in self._held:
            self.src.pool.buffers.put(b)
        self._held = []


def _map_in_memory(readers: list, device: torch.device) -> list:
    """The file readers whose drive is memory (tmpfs, ramfs), each given its ``io.mapped.FileMaps`` (page-locked for
    CUDA when ``device`` is): the reader pool then takes their files' pages in place of copies."""
    out = []
    for r in readers:
        if isinstance(r, FileDriveReader) and (r.maps is not None or io_mapped.memory_fs(r.root)):
            if r.maps is None:
                r.maps = io_mapped.FileMaps(r.label)
            r.maps.cuda = r.maps.cuda or device.type == "cuda"
            out.append(r)
    return out


VERIFY_ON = ("auto", "host", "gpu")


def _gpu_checks(verify_on: str, device: torch.device) -> bool:
    """Whether reads are checked on the GPU: ``auto`` where the device is CUDA and the xxh3 kernel is present,
    ``gpu`` required (refused elsewhere), ``host`` never."""
    if verify_on not in VERIFY_ON:
        raise UsageError(f"--verify-on {verify_on}: not one of {', '.join(VERIFY_ON)}")
    if verify_on == "host":
        return False
    from deltafin import kernels

    if kernels.xxh3_available(device):
        return True
    if verify_on == "gpu":
        raise UsageError(f"--verify-on gpu: no xxh3 kernel for {device} (it needs a CUDA device and Triton); "
                         f"use --verify-on auto or host")
    return False
