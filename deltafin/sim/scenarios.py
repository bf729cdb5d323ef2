"""The what-if questions users ask, answered with the simulator, and plots of the answers."""

from __future__ import annotations

import logging
from dataclasses import replace

from deltafin.io.emulator import DriveModel, parse_spec
from deltafin.sim.engine import SimConfig, simulate
from deltafin.sim.model import KIMI_K3, MoEShape, report_drives
from deltafin.sim.plots import write_plots  # noqa: F401 - the simulator's public API (deltafin.sim)

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
                  cache_gb: tuple[float, ...] = CACHE_GB[1:], on_done=None) -> list[dict]:
    """Simulate every standard scenario; one dict per scenario (see ``simulate`` for the keys).

    ``drives`` may be an ``--emulate-drives`` spec string. Kimi K3 at full scale takes about a
    minute; fewer ``tokens`` or ``prompt=0`` (no prefill) make it quicker. ``on_done(n)`` is called as
    scenarios finish (progress), after ``on_done.total`` is set when it has that attribute.
    """
    if isinstance(drives, str):
        drives = parse_spec(drives)
    out = []
    cfgs = scenario_configs(shape, tokens=tokens, prompt=prompt, seed=seed, drives=drives, cache_gb=cache_gb)
    for cfg in cfgs:
        rec = simulate(cfg)
        if on_done is not None:
            on_done(1)
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
    curves["striping"] = striping_records(shape, tokens=tokens, seed=seed)
    curves["cache"] = [simulate(SimConfig(shape, report_drives(4), name=f"{gb} GB cache", cache_bytes=gb * GB,
                                          tokens=tokens, prompt=0, seed=seed)) for gb in CACHE_GB]
    return curves


def striping_records(shape: MoEShape = KIMI_K3, *, tokens: int = 4, seed: int = 0) -> list[dict]:
    """The README's striping question: on the report's drives and with the internal drive twice as fast,
    one file per expert vs RAID-0 (equal pieces) vs pieces sized by rate."""
    base = report_drives(4)
    fast = (replace(base[0], gbps=2 * base[0].gbps),) + tuple(base[1:])
    out = []
    for set_name, drives in (("M5 Max write-up's 4 drives", base), ("internal 2x faster + 3", fast)):
        for layout in ("bandwidth", "raid0", "stripe"):
            rec = simulate(SimConfig(shape, drives, name=f"{set_name}, {layout}", tokens=tokens, prompt=0, seed=seed,
                                     layout="placed" if layout == "bandwidth" else layout))
            out.append(rec | {"set": f"{set_name}\n({sum(d.gbps for d in drives):.0f} GB/s summed)",
                              "layout": layout})
    return out


def format_table(records: list[dict]) -> str:
    """A plain-text table of scenario records (tok/s beside its bytes-bound, TTFT, makespans)."""
    head = f"{'scenario':52s} {'tok/s':>7s} {'bound':>7s} {'used':>5s} {'TTFT s':>7s} {'p50 ms':>7s} {'p99 ms':>7s}"
    rows = [head]
    for r in records:
        ttft = f"{r['ttft_s']:7.1f}" if r.get("ttft_s") is not None else f"{'-':>7s}"
        rows.append(f"{r['name'][:52]:52s} {r['tok_s']:7.3f} {r['bytes_bound_tok_s']:7.3f} "
                    f"{100 * r['aggregate_fraction']:4.0f}% {ttft} {r['makespan_ms_p50']:7.1f} {r['makespan_ms_p99']:7.1f}")
    return "\n".join(rows)
