"""Expert copies into the CUDA slab on a stream of their own.

On the consumer's stream a layer's copies queued behind whatever GPU work came before its fetch: the previous
layer's expert math in a plain decode, the shared experts of decode's side stage with CUDA graphs. On their own
stream they run beside it. Each copy still waits for every launch that read its slot before: a slot handed out
by fetch n was read by launches queued before fetch n + 1 began, so a copy into it waits for an event recorded on
the consumer's stream at that fetch's start (the slab's scratch ring reuses a slot some layers later, when that
event is long complete). The consumer's stream waits for each copy before anything queued after it, so every
launch reads the bytes it read before, and the logits are the same. ``DELTAFIN_COPY_STREAM=0`` copies on the
consumer's stream as before.
"""

from __future__ import annotations

import os
from collections import deque

import torch

ENABLED = os.environ.get("DELTAFIN_COPY_STREAM", "1") != "0"
KEEP = 256  # fetch-start events kept; a slot last used longer ago waits for the oldest (all of them done by then)


class SlabCopies:
    """Copies into one slab's slots on a side stream, ordered after the slots' earlier readers."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.current_stream())  # the slab's own allocation and zeroing come first
        self.fetch = 0  # fetches begun
        self._marks: deque[tuple[int, torch.cuda.Event]] = deque()  # (fetch, event on the consumer's stream)
        self._last: dict[int, int] = {}  # slot -> the fetch that last handed it out
        self._waited = 0  # the newest fetch mark the copy stream already waits for

    def begin(self) -> None:
        """A fetch begins: everything queued on the consumer's stream so far comes before this mark."""
        self.fetch += 1
        ev = torch.cuda.Event()
        ev.record()
        self._marks.append((self.fetch, ev))
        if len(self._marks) > KEEP:
            self._marks.popleft()

    def used(self, slot: int) -> None:
        """``slot`` is handed out by the current fetch: launches queued before the next fetch may read it."""
        self._last[slot] = self.fetch

    def write(self, slab, slot: int, data: torch.Tensor) -> None:
        """``slab.write_file(slot, data)`` on the copy stream, after the slot's earlier readers; the consumer's
        stream waits for it before its next work."""
        last = self._last.get(slot)
        if last is not None:
            self._after(last + 1)
        with torch.cuda.stream(self.stream):
            slab.write_file(slot, data)
        done = torch.cuda.Event()
        done.record(self.stream)
        torch.cuda.current_stream().wait_event(done)
        self.used(slot)

    def _after(self, fetch: int) -> None:
        """Make the copy stream wait for the first mark at or after ``fetch`` (events of one stream complete in
        order, so waiting for one covers the earlier ones)."""
        if fetch <= self._waited:
            return
        for n, ev in self._marks:
            if n >= fetch:
                self.stream.wait_event(ev)
                self._waited = n
                return
        # no mark that late: the slot was handed out by this fetch, which _take_slot never gives out twice
        self.stream.wait_stream(torch.cuda.current_stream())
        self._waited = self.fetch
