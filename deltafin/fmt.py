"""Human-readable sizes, rates and durations: the one formatter every printed figure goes through.

Sizes are decimal (1 GB = 10**9 bytes), as drive makers and the rest of Deltafin count them.
"""

from __future__ import annotations

_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")


def size(n: float) -> str:
    """1_446_800_000_000 -> '1.45 TB'; 17_551_360 -> '17.6 MB'; 512 -> '512 B'."""
    x, unit = float(n), 0
    while abs(x) >= 1000 and unit < len(_UNITS) - 1:
        x /= 1000
        unit += 1
    if unit == 0:
        return f"{int(x)} B"
    return f"{_num(x)} {_UNITS[unit]}"


def _num(x: float) -> str:
    """Three significant figures without exponents: 1.45, 17.6, 512."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def rate(bytes_per_s: float) -> str:
    """Bytes per second -> '6.50 GB/s', '512 MB/s'."""
    return size(bytes_per_s) + "/s"


def gbps(g: float) -> str:
    """A rate already in GB/s (as drives are given on the command line) -> '6.5 GB/s', '450 MB/s'."""
    return rate(g * 1e9)


def duration(s: float) -> str:
    """Seconds -> '350 ms', '4.2 s', '24 min 07 s', '2 h 05 min', '3 d 04 h'."""
    if s != s or s < 0:  # NaN or negative: nothing sensible to show
        return "?"
    if s < 1:
        return f"{_num(s * 1000)} ms" if s >= 0.001 else f"{_num(s * 1e6)} us"
    if s < 60:
        return f"{_num(s)} s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m} min {sec:02d} s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h} h {m:02d} min"
    d, h = divmod(h, 24)
    return f"{d} d {h:02d} h"


def count(n: int) -> str:
    """Thousands separators: 82432 -> '82,432'."""
    return f"{n:,}"
