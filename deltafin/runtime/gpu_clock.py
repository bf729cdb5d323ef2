"""Where a CUDA run's time goes, on the GPU's clock: the host launches work asynchronously, so host timers
around a launch measure the launch, not the math, and a host wait on a read overlaps GPU work still queued.

``GpuClock`` records CUDA events instead: a *span* is the GPU time between an event before some launches and
one after them (the expert math of a layer); a *wait* is a host wait on a read, of which only the part after
the GPU ran out of queued work counts as waiting on I/O (the GPU idle for want of experts). Event times are
put on the host's clock through an anchor event recorded while the GPU is idle. Nothing synchronises on the
hot path: ``settle`` (after the run's last step) resolves the events in one go."""

from __future__ import annotations

import time

import torch


class GpuClock:
    SETTLE_AT = 8192  # resolve completed events once this many are pending (long runs)

    def __init__(self, device: torch.device):
        self.device = device
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._waits: list[tuple[float, float, torch.cuda.Event]] = []
        self._anchor: tuple[torch.cuda.Event, float] | None = None
        self.math_s = 0.0  # resolved so far
        self.idle_s = 0.0

    def _event(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def anchor(self) -> None:
        """Pin GPU time to host time: the device is drained, then an event is recorded and waited for."""
        torch.cuda.synchronize(self.device)
        ev = self._event()
        ev.synchronize()
        self._anchor = (ev, time.perf_counter())

    def start(self) -> torch.cuda.Event:
        return self._event()

    def end(self, start: torch.cuda.Event) -> None:
        self._spans.append((start, self._event()))
        if len(self._spans) > self.SETTLE_AT:
            self._resolve(partial=True)

    def mark(self) -> torch.cuda.Event | None:
        """Before a host wait on a read: an event after the work queued so far (None without an anchor)."""
        return self._event() if self._anchor is not None else None

    def waited(self, t0: float, t1: float, ev: torch.cuda.Event | None) -> None:
        """The host waited from ``t0`` to ``t1``; without an anchor the whole wait counts."""
        if ev is None:
            self.idle_s += t1 - t0
        else:
            self._waits.append((t0, t1, ev))

    def settle(self) -> tuple[float, float]:
        """(GPU seconds of the spans, seconds the GPU sat idle on host waits), all resolved; re-anchors."""
        torch.cuda.synchronize(self.device)
        self._resolve(partial=False)
        self.anchor()
        return self.math_s, self.idle_s

    def _resolve(self, partial: bool) -> None:
        keep = []
        for a, b in self._spans:
            if partial and not b.query():
                keep.append((a, b))
                continue
            self.math_s += a.elapsed_time(b) / 1e3
        self._spans = keep
        if self._anchor is None:
            return
        ref, h = self._anchor
        waits = []
        for t0, t1, ev in self._waits:
            if partial and not ev.query():
                waits.append((t0, t1, ev))
                continue
            drained = h + ref.elapsed_time(ev) / 1e3  # when the GPU finished what was queued before the wait
            self.idle_s += max(0.0, t1 - max(t0, drained))
        self._waits = waits
