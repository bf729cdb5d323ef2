"""PNG plots of the simulator's answers, drawn so a reader sees the point at a glance: series named as the
``--placement`` policies of the CLI, every value axis from 0, no two lines drawn on top of each other.

``figure_data`` turns ``scaling_curves`` output into plain series (testable without matplotlib);
``write_plots`` draws them.
"""

from __future__ import annotations

import logging
import math
import os

log = logging.getLogger(__name__)

# simulator layout/policy -> (CLI policy name, what it is), in legend order
SERIES = {
    "bandwidth": ("bandwidth", "one file per expert, balanced by rate"),
    "stripe": ("stripe-bandwidth", "pieces sized by rate"),
    "raid0": ("stripe-equal", "RAID-0: equal pieces"),
    "roundrobin": ("roundrobin", "one file per expert, equal counts"),
}
SEPARATION = 0.02  # two lines closer than this (fraction of the axis) at every point would read as one


def legend(key: str) -> str:
    name, what = SERIES[key]
    return f"{name} ({what})"


def _apart(a: list[float], b: list[float], span: float) -> bool:
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) > SEPARATION * span


def scaling_series(curves: dict[str, list[dict]]) -> dict:
    """Decode tok/s against drive count, per layout, with the summed-read-rate bound. A layout whose line
    would lie on one already drawn (e.g. roundrobin on bandwidth when drives are alike) is left out and
    named in ``merged`` (the figure's note says so)."""
    keys = [k for k in SERIES if k in curves]
    first = curves[keys[0]]
    bound = [p["no_cache_bound_tok_s"] for p in first]
    span = max(bound)
    lines, merged = {}, {}
    for k in keys:
        ys = [p["tok_s"] for p in curves[k]]
        same = next((o for o, oy in lines.items() if not _apart(ys, oy, span)), None)
        if same is None:
            lines[k] = ys
        else:
            merged[k] = same
    return {"x": [p["drives"] for p in first], "lines": lines, "merged": merged, "bound": bound,
            "model": first[0]["model"]}


def striping_series(records: list[dict]) -> dict:
    """The README's striping argument: per drive set, tok/s of one file per expert, RAID-0 and pieces by
    rate, beside the set's bound."""
    sets: list[str] = []
    for r in records:
        if r["set"] not in sets:
            sets.append(r["set"])
    bars = {k: [next(r["tok_s"] for r in records if r["set"] == s and r["layout"] == k) for s in sets]
            for k in ("bandwidth", "raid0", "stripe")}
    bound = [next(r["no_cache_bound_tok_s"] for r in records if r["set"] == s) for s in sets]
    return {"sets": sets, "bars": bars, "bound": bound, "model": records[0]["model"]}


def write_plots(curves: dict[str, list[dict]], out_dir: str) -> list[str]:
    """PNG plots of ``scaling_curves`` output into ``out_dir``; returns the paths written.

    Needs matplotlib (``pip install 'deltafin[plot]'``); without it, logs that and writes nothing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plots written; pip install 'deltafin[plot]'")
        return []
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    if any(k in curves for k in SERIES):
        paths.append(_plot_scaling(plt, scaling_series(curves), out_dir))
    if curves.get("striping"):
        paths.append(_plot_striping(plt, striping_series(curves["striping"]), out_dir))
    if curves.get("cache"):
        paths.append(_plot_cache(plt, curves["cache"], out_dir))
    return paths


def _plot_scaling(plt, s: dict, out_dir: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = iter("osD^")
    for k, ys in s["lines"].items():
        also = [SERIES[m][0] for m, o in s["merged"].items() if o == k]
        ax.plot(s["x"], ys, marker=next(markers), zorder=3,
                label=legend(k) + (f"; {', '.join(also)} gives the same line" if also else ""))
    # the bound as a shaded region, not a line: the best layouts reach it and would hide under a line
    ax.fill_between(s["x"], 0, s["bound"], color="0.88", zorder=1,
                    label="reachable: up to summed read rate / bytes per token")
    ax.set_xscale("log")
    ax.set_xticks(s["x"], [str(x) for x in s["x"]])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("drives (internal 7 GB/s + Thunderbolt 6 GB/s externals; log scale)")
    ax.set_ylabel("decode tok/s (from 0)")
    ax.set_title(f"{s['model']}: decode vs number of drives")
    return _save(plt, fig, ax, out_dir, "scaling_drives.png", "upper left")


def _plot_striping(plt, s: dict, out_dir: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    n, width = len(s["sets"]), 0.26
    for i, k in enumerate(("bandwidth", "raid0", "stripe")):
        xs = [j + (i - 1) * width for j in range(n)]
        rects = ax.bar(xs, s["bars"][k], width, label=legend(k))
        ax.bar_label(rects, [f"{v:.2f}\n{v / b:.0%}" for v, b in zip(s["bars"][k], s["bound"], strict=True)],
                     fontsize=7, label_type="center")
    for j, b in enumerate(s["bound"]):
        ax.hlines(b, j - 1.5 * width, j + 1.5 * width, colors="k", linestyles="--",
                  label="bound: summed read rate / bytes per token" if j == 0 else None)
    ax.set_xticks(range(n), s["sets"])
    ax.set_ylim(0, max(s["bound"]) * 1.6)  # room for the legend above the bars
    ax.set_ylabel("decode tok/s (from 0; % of the bound on each bar)")
    ax.set_title(f"{s['model']}: stripe by rate vs RAID-0 vs one file per expert")
    return _save(plt, fig, ax, out_dir, "striping.png", "upper left")


def _plot_cache(plt, pts: list[dict], out_dir: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p["cache_gb"] for p in pts]
    ax.plot(xs, [p["tok_s"] for p in pts], marker="o", label="bandwidth placement, simulated")
    # a cache that holds every expert reads nothing: no finite bound there (not drawn)
    bound = [b if math.isfinite(b) else math.nan for b in (p["bytes_bound_tok_s"] for p in pts)]
    ax.plot(xs, bound, "k--", label="bound: summed read rate / bytes read per token")
    ax.set_xlabel("expert cache (GB)")
    ax.set_ylabel("decode tok/s (from 0)")
    ax.set_title(f"{pts[0]['model']}: decode vs expert cache (uniform routing)")
    ax.set_ylim(0, max(v for v in bound + [p["tok_s"] for p in pts] if math.isfinite(v)) * 1.3)
    return _save(plt, fig, ax, out_dir, "scaling_cache.png", "upper left")


def _save(plt, fig, ax, out_dir: str, name: str, where: str) -> str:
    ax.legend(loc=where, fontsize=8)
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
