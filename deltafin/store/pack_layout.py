"""What a pack and a repack share, below both: the run's summary, the drives with their rates, and the
layout of expert files over them."""

from __future__ import annotations

import os
from dataclasses import dataclass

from deltafin.store import manifest as mf
from deltafin.store.drives import DriveArg, ensure_writable, measured_rates
from deltafin.store.place import Layout, plan_layout
from deltafin.store.placement import DriveSpec


@dataclass
class PackSummary:
    out: str
    model_id: str
    expert_files: int
    written: int
    skipped: int
    repaired: int
    expert_bytes: int
    bytes_written: int
    trunk_bytes: int
    seconds: float
    peak_rss_bytes: int
    per_drive: dict[str, dict]
    moved: tuple[int, int] | None = None  # a re-run with new rates or placement: (files copied, files deleted)
    removed: int = 0  # files of an old layout (a repack) or of the model replaced by --overwrite, deleted

    @property
    def write_gbps(self) -> float:
        return self.bytes_written / max(self.seconds, 1e-9) / 1e9


def resolve_drives(out: str, args: list[DriveArg], known: dict[str, list] | None = None) -> list[mf.DriveEntry]:
    """Drive entries with rates; no --drive means one drive at OUT/experts. ``known`` holds the rates
    (label -> [gbps, measured]) recorded by an earlier run of this pack, which are kept, not re-measured.
    Folders on one filesystem are probed once and share its measured rate equally."""
    if not args:
        args = [DriveArg("d0", os.path.join(os.path.abspath(out), "experts"), None)]
    for a in args:
        ensure_writable(a.path, a.label)
    rates = measured_rates([a for a in args if a.gbps is None and not (known and a.label in known)])
    entries = []
    for a in args:
        if known and a.label in known:
            gbps, measured = float(known[a.label][0]), bool(known[a.label][1])
        else:
            gbps, measured = (a.gbps, False) if a.gbps is not None else (rates[a.label], True)
        entries.append(mf.DriveEntry(a.label, a.path, gbps, measured))
    return entries


def plan_drive_layout(plan, drives: list[mf.DriveEntry], opts) -> Layout:
    """Where each expert file of ``plan`` (a PackPlan) goes over ``drives``, by ``opts``' (PackOptions) placement,
    trace and spare room."""
    trace = None
    if opts.trace:
        from deltafin.io.routes import read_routes

        trace = read_routes(opts.trace, plan.num_experts)
    return plan_layout({L: plan.layouts[L].file_bytes for L in plan.moe_layers}, plan.num_experts,
                       [DriveSpec(d.label, d.gbps) for d in drives], opts.placement, trace=trace,
                       spare_gb=opts.spare_gb)
