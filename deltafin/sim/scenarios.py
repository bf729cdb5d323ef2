"""The what-if questions users ask, answered with the simulator, and plots of the answers."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from deltafin.io.emulator import DriveModel, parse_spec
from deltafin.sim.engine import SimConfig, simulate
from deltafin.sim.model import KIMI_K3, MoEShape, report_drives

log = logging.getLogger(__name__)

GB = 10**9
DRIVE_COUNTS = (1, 2, 4, 8, 16, 40)
CACHE_GB = (0, 16, 32, 64)


def scenario_configs(shape: MoEShape = KIMI_K3, *, tokens: int = 8, prompt: int = 512, seed: int = 0,
                     drives: tuple[DriveModel, ...] | None = None,
                     cache_gb: tuple[float, ...] = CACHE_GB[1:]) -> list[SimConfig]:
    """The standard scenarios: the report's drives with each placement and layout, the internal
    drive alone, 8/16/40 drives, ``cache_gb`` cache sizes, and a skewed router with caching and
    replicas.

    ``drives`` replaces the report's four drives (e.g. ``parse_spec("report4@0.04")``).
    """
    base_drives = drives or report_drives(4)
    base = SimConfig(shape, base_drives, tokens=tokens, prompt=prompt, seed=seed)
    named = [
        replace(base, name="report drives, bandwidth placement"),
        replace(base, name="report drives, co-activation placement", policy="coactivation"),
        replace(base, name="report drives, round-robin (equal) placement", policy="roundrobin"),
        replace(base, name="report drives, RAID-0 striping", layout="raid0"),
        replace(base, name="report drives, bandwidth striping", layout="stripe"),
        replace(base, name="internal drive alone", drives=base_drives[:1]),
    ]
    fast = (replace(base_drives[0], gbps=2 * base_drives[0].gbps),) + tuple(base_drives[1:])
    named.append(replace(base, name="fast internal (2x), RAID-0 striping", drives=fast, layout="raid0"))
    named.append(replace(base, name="fast internal (2x), bandwidth striping", drives=fast, layout="stripe"))
    for n in (8, 16, 40):
        drives_n = _scaled_like(report_drives(n), base_drives)
        named.append(replace(base, name=f"{n} drives (internal + {n - 1} external)", drives=drives_n))
        named.append(replace(base, name=f"{n} drives, bandwidth striping", drives=drives_n, layout="stripe"))
    clustered = replace(base, group=4, affinity=0.9, prompt=0)
    named.append(replace(clustered, name="clustered router (groups of 4), bandwidth placement"))
    named.append(replace(clustered, name="clustered router (groups of 4), co-activation placement",
                         policy="coactivation"))
    for gb in cache_gb:
        named.append(replace(base, name=f"report drives, {gb:g} GB cache", cache_bytes=int(gb * GB), prompt=0))
    mid = int(cache_gb[len(cache_gb) // 2] * GB) if cache_gb else 0
    named.append(replace(base, name=f"report drives, skewed router (Zipf 1.0), {mid / GB:g} GB cache", skew=1.0,
                         cache_bytes=mid, prompt=0))
    named.append(replace(base, name=f"report drives, skewed router, {mid / GB:g} GB cache, replicas", skew=1.0,
                         cache_bytes=mid, prompt=0, policy="replicas", spare_fraction=0.2))
    return named


def _scaled_like(drives: tuple[DriveModel, ...], base: tuple[DriveModel, ...]) -> tuple[DriveModel, ...]:
    """``drives`` scaled by the factor that turned the report's four drives into ``base``."""
    factor = sum(d.gbps for d in base) / sum(d.gbps for d in report_drives(len(base))) if len(base) else 1.0
    return tuple(d.scaled(factor) for d in drives) if abs(factor - 1) > 1e-9 else drives


def run_scenarios(shape: MoEShape = KIMI_K3, *, tokens: int = 8, prompt: int = 512, seed: int = 0,
                  drives: tuple[DriveModel, ...] | str | None = None,
                  cache_gb: tuple[float, ...] = CACHE_GB[1:]) -> list[dict]:
    """Simulate every standard scenario; one dict per scenario (see ``simulate`` for the keys).

    ``drives`` may be an ``--emulate-drives`` spec string. Kimi K3 at full scale takes about a
    minute; fewer ``tokens`` or ``prompt=0`` (no prefill) make it quicker.
    """
    if isinstance(drives, str):
        drives = parse_spec(drives)
    out = []
    for cfg in scenario_configs(shape, tokens=tokens, prompt=prompt, seed=seed, drives=drives, cache_gb=cache_gb):
        rec = simulate(cfg)
        log.info("%s: %.3f tok/s (%.0f%% of summed read rate)", rec["name"], rec["tok_s"],
                 100 * rec["aggregate_fraction"])
        out.append(rec)
    return out


def scaling_curves(shape: MoEShape = KIMI_K3, *, tokens: int = 4, seed: int = 0) -> dict[str, list[dict]]:
    """tok/s against drive count (bandwidth placement, bandwidth striping, RAID-0, round-robin) and
    against cache size."""
    curves: dict[str, list[dict]] = {}
    for label, policy, layout in (("bandwidth", "bandwidth", "placed"), ("stripe", "bandwidth", "stripe"),
                                  ("raid0", "bandwidth", "raid0"), ("roundrobin", "roundrobin", "placed")):
        curves[label] = [simulate(SimConfig(shape, report_drives(n), name=f"{n} drives {label}", policy=policy,
                                            layout=layout, tokens=tokens, prompt=0, seed=seed))
                         for n in DRIVE_COUNTS]
    curves["cache"] = [simulate(SimConfig(shape, report_drives(4), name=f"{gb} GB cache", cache_bytes=gb * GB,
                                          tokens=tokens, prompt=0, seed=seed)) for gb in CACHE_GB]
    return curves


def format_table(records: list[dict]) -> str:
    """A plain-text table of scenario records (tok/s beside its bytes-bound, TTFT, makespans)."""
    head = f"{'scenario':52s} {'tok/s':>7s} {'bound':>7s} {'used':>5s} {'TTFT s':>7s} {'p50 ms':>7s} {'p99 ms':>7s}"
    rows = [head]
    for r in records:
        ttft = f"{r['ttft_s']:7.1f}" if r.get("ttft_s") is not None else f"{'-':>7s}"
        rows.append(f"{r['name'][:52]:52s} {r['tok_s']:7.3f} {r['bytes_bound_tok_s']:7.3f} "
                    f"{100 * r['aggregate_fraction']:4.0f}% {ttft} {r['makespan_ms_p50']:7.1f} {r['makespan_ms_p99']:7.1f}")
    return "\n".join(rows)


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
    paths = [_plot_drives(plt, curves, out_dir)]
    if "cache" in curves:
        paths.append(_plot_cache(plt, curves["cache"], out_dir))
    return paths


def _plot_drives(plt, curves: dict[str, list[dict]], out_dir: str) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    for label in ("bandwidth", "stripe", "raid0", "roundrobin"):
        if label in curves:
            pts = curves[label]
            ax.plot([p["drives"] for p in pts], [p["tok_s"] for p in pts], marker="o", label=label)
    bound = curves.get("bandwidth") or next(iter(curves.values()))
    ax.plot([p["drives"] for p in bound], [p["no_cache_bound_tok_s"] for p in bound], "k--", label="summed rate bound")
    ax.set_xscale("log")
    ax.set_xlabel("drives (internal + Thunderbolt externals)")
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"{bound[0]['model']}: decode vs drive count")
    return _save(plt, fig, ax, out_dir, "scaling_drives.png")


def _save(plt, fig, ax, out_dir: str, name: str) -> str:
    ax.legend()
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_cache(plt, pts: list[dict], out_dir: str) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["cache_gb"] for p in pts], [p["tok_s"] for p in pts], marker="o", label="simulated")
    ax.plot([p["cache_gb"] for p in pts], [p["bytes_bound_tok_s"] for p in pts], "k--", label="bytes bound")
    ax.set_xlabel("expert cache (GB)")
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"{pts[0]['model']}: decode vs cache size (uniform routing)")
    return _save(plt, fig, ax, out_dir, "scaling_cache.png")
