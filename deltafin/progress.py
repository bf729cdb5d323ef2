"""Progress for long steps: a tqdm bar on a terminal; elsewhere (logs, CI, pipes) plain lines with the
fraction done, the rate and the time left, at most one every few seconds, so logs hold no bar frames."""

from __future__ import annotations

import sys
import time

from deltafin import fmt


class PlainProgress:
    """The part of tqdm's interface Deltafin uses (update, set_postfix_str, close, with-block)."""

    def __init__(self, total: float, desc: str, unit: str = "B", file=None, every_s: float = 10.0):
        self.total, self.desc, self.unit = total, desc, unit
        self.file = file or sys.stderr
        self.every_s = every_s
        self.n, self.postfix = 0.0, ""
        self.t0 = self._last = time.monotonic()
        self._closed = self._shown = False

    def _amount(self, x: float) -> str:
        return fmt.size(x) if self.unit == "B" else f"{x:,.0f} {self.unit}"

    def line(self) -> str:
        dt = time.monotonic() - self.t0
        rate = self.n / dt if dt > 0 else 0.0
        parts = [f"{self.desc}: {self._amount(self.n)}"]
        if self.total:
            parts[0] += f" of {self._amount(self.total)} ({self.n / self.total:.0%})"
        if rate > 0:
            parts.append(fmt.rate(rate) if self.unit == "B" else f"{rate:,.2f} {self.unit}/s")
            if self.total and self.n < self.total:
                parts.append(f"ETA {fmt.duration((self.total - self.n) / rate)}")
        parts.append(f"elapsed {fmt.duration(dt)}")
        return ", ".join(parts) + (f"; {self.postfix}" if self.postfix else "")

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self._emit()

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        self.postfix = s

    def _emit(self) -> None:
        self._shown = True
        print(self.line(), file=self.file, flush=True)

    def close(self) -> None:
        """A last line, unless the step was quick and silent (no line for what took under two seconds)."""
        if not self._closed:
            self._closed = True
            if self.n and (self._shown or time.monotonic() - self.t0 >= 2.0):
                self._emit()

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NoProgress(PlainProgress):
    def _emit(self) -> None:
        pass


def bar(total: float, desc: str, unit: str = "B", enabled: bool = True, file=None, leave: bool = True):
    """A progress bar for ``total`` units: tqdm when ``file`` (stderr) is a terminal, plain lines otherwise.
    ``leave=False``: the terminal bar is erased when done (steps that recur, like each turn's prefill)."""
    file = file or sys.stderr
    if not enabled:
        return NoProgress(total, desc, unit, file)
    if _isatty(file):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1000, file=file,
                    dynamic_ncols=True, leave=leave)
    return PlainProgress(total, desc, unit, file)


def _isatty(f) -> bool:
    try:
        return f.isatty()
    except (AttributeError, ValueError):
        return False
