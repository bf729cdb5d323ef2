"""Compute threads for CPU decode steps, chosen by measurement so that a step never runs slower than it would on
fewer threads: on a loaded machine one thread descheduled at a barrier stalls all the others, and a one-token
step of a small model can be faster on fewer threads.

Every ``every`` steps each candidate count (all threads, half, one) runs ``trial`` steps; the count with the
least median compute time (the step's wall time less its waits on reads) is kept until the next trial. The fast
path's results do not depend on the thread count (its kernels split a matrix's rows, never its sums:
tests/test_determinism.py), so a trial costs only the time of the slower counts' steps. Plain Python: the
count is applied by the caller."""

from __future__ import annotations

import statistics


class ThreadPolicy:
    def __init__(self, most: int, trial: int = 3, every: int = 96):
        if most < 1:
            raise ValueError(f"compute threads must be >= 1, got {most}")
        self.most, self.trial, self.every = most, trial, every
        self.options = sorted({most, max(1, most // 2), 1}, reverse=True)
        self.best = most
        self._plan: list[int] = []
        self._times: dict[int, list[float]] = {}
        self._since = every  # a trial at the first step
        self.trials = 0

    def next(self) -> int:
        """The thread count for the next decode step."""
        if not self._plan and self._since >= self.every and len(self.options) > 1:
            self._plan = [c for c in self.options for _ in range(self.trial)]
            self._times = {c: [] for c in self.options}
        return self._plan[0] if self._plan else self.best

    def done(self, count: int, seconds: float) -> None:
        """The step run at ``count`` threads took ``seconds`` of compute."""
        if not self._plan:
            self._since += 1
            return
        self._plan.pop(0)
        self._times[count].append(seconds)
        if not self._plan:  # ties go to more threads (the order of options)
            self.best = min(self.options, key=lambda c: statistics.median(self._times[c]))
            self._since, self.trials = 0, self.trials + 1
