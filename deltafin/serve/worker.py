"""The one thread that owns the engine: requests queue, arrivals prefill together, everyone decodes together.

Each loop: admit queued sequences (up to ``max_batch`` in flight), prefill the new ones in one shared-read
pass, sample one token for every sequence in flight, then advance them all in one ``forward_batch`` step.
A sequence whose client went away is dropped before the next step. Results go back to the caller through
its ``deliver`` callback (thread-safe on the caller's side). A failed prefill fails only the sequence that
failed (each is retried alone); a failed batched decode step fails the sequences in that step, and the
worker carries on with the next requests.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from deltafin.errors import DeltafinError, UsageError
from deltafin.runtime.batched import BatchDecoder, GenSpec, Seq, TokenOut

log = logging.getLogger(__name__)


class QueueFull(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Failure:
    """A sequence that could not be generated: HTTP status and a message safe to show the client."""

    status: int
    message: str
    type: str = "server_error"


@dataclass(eq=False)
class Job:
    """One sequence asked for by one request. ``deliver`` receives TokenOut or Failure events."""

    spec: GenSpec
    deliver: Callable[[object], None]
    index: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class WorkerCounters:
    requests_ok: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0
    peak_batch: int = 0  # most sequences decoded in one step
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # (time, tokens) per step


class Worker:
    def __init__(self, engine, max_batch: int = 16, max_queue: int = 64, gather_s: float = 0.005,
                 prompt_cache=None):
        self.engine = engine
        self.codec_lock = threading.Lock()
        self.prompt_cache = prompt_cache  # a PromptCache shared by all requests, or None
        self.decoder = BatchDecoder(engine, self.codec_lock, prompt_cache)
        self.max_batch, self.max_queue, self.gather_s = max_batch, max_queue, gather_s
        self.queue: queue.Queue[Job] = queue.Queue()
        self.active: list[Seq] = []
        self.counters = WorkerCounters()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="deltafin-engine", daemon=True)

    # -- caller side (any thread)
    def start(self) -> Worker:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queued(self) -> int:
        return self.queue.qsize()

    @property
    def in_flight(self) -> int:
        return len(self.active)

    def submit(self, jobs: list[Job]) -> None:
        if self.queue.qsize() + len(jobs) > self.max_queue:
            raise QueueFull(f"{self.queue.qsize()} requests are waiting (limit {self.max_queue}); retry shortly")
        for j in jobs:
            self.queue.put(j)

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self.counters.recent) if now - t <= window_s]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / span

    # -- engine thread
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._take_up_layout()
                fresh = self._admit()
                self._take_up_layout()  # also after the wait for arrivals: place may have committed meanwhile
                if fresh:
                    self._prefill(fresh)
                if self.active:
                    self._step()
            except Exception:  # never let the engine thread die: fail what is in flight and go on
                log.exception("engine step failed")
                self._fail(self.active, Failure(500, "internal error while generating; see the server log"))
                self.active = []

    def _take_up_layout(self) -> None:
        """Between two steps (no read in flight): a 'deltafin place' that moved expert files committed a new
        layout generation; reading from it now lets place delete the old files while requests keep working."""
        packed = getattr(self.engine, "packed", None)
        refresh = getattr(packed, "refresh", None)
        if refresh is not None and refresh():
            log.warning("took up the new layout of %s (generation %d)", packed.path, packed.generation)

    def _admit(self) -> list[Seq]:
        room = self.max_batch - len(self.active)
        if room <= 0:
            return []
        fresh: list[Seq] = []
        try:
            if not self.active:  # idle: wait for work, then give companions a moment to arrive
                fresh.append(self._wrap(self.queue.get(timeout=0.1)))
                deadline = time.monotonic() + self.gather_s
                while len(fresh) < room and (left := deadline - time.monotonic()) > 0:
                    fresh.append(self._wrap(self.queue.get(timeout=left)))
            while len(fresh) < room:
                fresh.append(self._wrap(self.queue.get_nowait()))
        except queue.Empty:
            pass
        live = [s for s in fresh if not self._cancelled(s)]
        return live

    @staticmethod
    def _wrap(job: Job) -> Seq:
        return Seq(job.spec, job)

    def _cancelled(self, s: Seq) -> bool:
        if s.tag.cancelled.is_set():
            self.counters.requests_cancelled += 1
            return True
        return False

    def _prefill(self, fresh: list[Seq]) -> None:
        failed = dict((id(s), e) for s, e in self.decoder.prefill(fresh))
        for s in fresh:
            if id(s) in failed:
                self._fail([s], failure_of(failed[id(s)]))
            else:
                self.active.append(s)

    def _step(self) -> None:
        self.active = [s for s in self.active if not self._cancelled(s)]
        outs = self.decoder.sample(self.active)
        self.counters.recent.append((time.monotonic(), len(outs)))
        self.counters.peak_batch = max(self.counters.peak_batch, len(outs))
        for out in outs:
            self._send(out.seq, out)
            if out.finish_reason:
                self.counters.requests_ok += 1
        self.active = [s for s in self.active if not s.done and not self._cancelled(s)]
        try:
            self.decoder.advance(self.active)
        except Exception as e:  # which sequence caused it is unknowable: fail the step's sequences
            log.exception("batched decode step failed")
            self._fail(self.active, failure_of(e))
            self.active = []

    def _fail(self, seqs: list[Seq], f: Failure) -> None:
        for s in seqs:
            self.counters.requests_failed += 1
            self._send(s, f)

    def _send(self, s: Seq, event: TokenOut | Failure) -> None:
        try:
            s.tag.deliver(event)
        except Exception:  # the caller is gone (loop closed): drop the sequence
            log.debug("could not deliver to a finished request", exc_info=True)
            s.tag.cancelled.set()


def failure_of(e: Exception) -> Failure:
    if isinstance(e, UsageError):
        return Failure(400, str(e), "invalid_request_error")
    if isinstance(e, DeltafinError):
        log.error("generation failed: %s: %s", type(e).__name__, e)
        return Failure(500, f"{type(e).__name__}: {e}")
    log.error("generation failed", exc_info=e)
    return Failure(500, "internal error while generating; see the server log")
