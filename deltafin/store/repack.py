"""A repeated ``deltafin pack`` whose only change is the drives' read rates or the placement: the expert
files are already there, so it moves only those that must move (as ``deltafin place`` does, crash-safe)
instead of rewriting every expert."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

from deltafin.store import manifest as mf
from deltafin.store.drives import DriveArg
from deltafin.store.pack_state import STATE, fingerprint
from deltafin.store.placement import ALL_POLICIES, TRACE_POLICIES
from deltafin.store.plan import PackPlan

log = logging.getLogger(__name__)


def same_files_other_rates(out: str, prior: dict | None, plan: PackPlan, drive_args: list[DriveArg],
                           model_id: str, opts, digest: str) -> bool:
    """True when ``prior`` was packed from the same source, formats, model id and drive folders as this run
    and differs only in read rates or placement (its fingerprint is reproduced with its own rates)."""
    if prior is None or opts.repair or prior.get("fingerprint") in (None, digest):
        return False
    if os.path.exists(os.path.join(out, STATE)):  # an unfinished pack: it resumes (or refuses) as before
        return False
    old = mf.drives(prior)
    where = [(d.label, os.path.realpath(d.path)) for d in old]
    if where != [(a.label, os.path.realpath(a.path)) for a in drive_args]:
        return False
    old_args = [DriveArg(d.label, d.path, None if d.measured else d.gbps) for d in old]
    plain = replace(opts, trace=None, spare_gb=None)
    return any(fingerprint(plan, old_args, model_id, replace(plain, placement=p)) == prior["fingerprint"]
               for p in ALL_POLICIES if p not in TRACE_POLICIES)


def move_to_new_rates(out: str, plan: PackPlan, drive_args: list[DriveArg], opts, digest: str):
    """Re-place the packed experts for the new rates and placement, then record the rates and the new
    fingerprint (a crash before that leaves a re-run that finds the files placed and records them)."""
    from deltafin.store.model_dir import PackedModel
    from deltafin.store.pack_layout import PackSummary, plan_drive_layout, resolve_drives
    from deltafin.store.place import apply_layout, resume

    t0 = time.perf_counter()
    resume(out, progress=opts.progress)
    drives = resolve_drives(out, drive_args)
    pm = PackedModel.open(out, reader=False)
    log.info("%s: same files, new drive rates or placement; moving only what must move", out)
    rep = apply_layout(pm, plan_drive_layout(plan, drives, opts), progress=opts.progress)
    doc = dict(pm.doc)
    doc["drives"] = [{"label": d.label, "path": d.path, "gbps": round(d.gbps, 3), "measured": d.measured}
                     for d in drives]
    doc["fingerprint"] = digest
    mf.write_json_atomic(os.path.join(out, mf.MANIFEST), doc)
    per_drive = {label: d | {"gbps": g.gbps} for (label, d), g in zip(rep.per_drive.items(), drives, strict=True)}
    return PackSummary(out, pm.model_id, plan.expert_files, rep.files_copied, rep.files_kept, 0, plan.expert_bytes,
                       rep.bytes_copied, plan.trunk_bytes, time.perf_counter() - t0, 0, per_drive,
                       moved=(rep.files_copied, rep.files_deleted))
