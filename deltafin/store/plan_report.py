"""``deltafin pack --plan``: what a pack would write, from config.json and the index alone."""

from __future__ import annotations

import os

from deltafin.errors import UsageError
from deltafin.store.checkpoint import Checkpoint
from deltafin.store.drives import DriveArg, free_bytes, measured_rates, mount_point
from deltafin.store.place import plan_layout
from deltafin.store.placement import ALL_POLICIES, TRACE_POLICIES, DriveSpec
from deltafin.store.plan import build_plan


def _rates(drives: list[DriveArg]) -> list[tuple[float, bool]]:
    for d in drives:
        if d.gbps is None and not os.path.isdir(d.path):
            raise UsageError(f"--drive {d.path}: folder does not exist, so its read rate cannot be measured; "
                             f"give it as {d.path}=GBPS")
    measured = measured_rates([d for d in drives if d.gbps is None])
    return [(d.gbps, False) if d.gbps is not None else (measured[d.label], True) for d in drives]


def _filesystems(drives: list[DriveArg], per_drive: dict[str, dict]) -> dict[str, dict]:
    """One entry per real filesystem: its free space and read rate counted once, whatever number of drive
    folders it holds. Its rate: the probe's (split over its folders, so their sum) or the largest one given."""
    out: dict[str, dict] = {}
    for d in drives:
        pd = per_drive[d.label]
        key = mount_point(d.path)
        fs = out.setdefault(key, {"drives": [], "free_bytes": free_bytes(d.path), "bytes": 0, "gbps": 0.0,
                                  "measured": pd["measured"]})
        fs["drives"].append(d.label)
        fs["bytes"] += pd["bytes"]
        fs["gbps"] = fs["gbps"] + pd["gbps"] if pd["measured"] else max(fs["gbps"], pd["gbps"])
    for fs in out.values():
        fs["seconds_at_rate"] = fs["bytes"] / (fs["gbps"] * 1e9)
        fs["fits"] = fs["free_bytes"] >= fs["bytes"]
    return out


def plan_report(ckpt: Checkpoint, drives: list[DriveArg], experts: str, trunk: str, policy: str) -> dict:
    if policy not in ALL_POLICIES or policy in TRACE_POLICIES:
        raise UsageError(f"--placement {policy!r}: a plan places experts with one of "
                         f"{', '.join(p for p in ALL_POLICIES if p not in TRACE_POLICIES)} (trace-based placements "
                         f"need a recorded trace: pack with --trace, or use 'deltafin place' later)")
    plan = build_plan(ckpt, experts, trunk)
    if not drives:
        drives = [DriveArg("d0", os.path.abspath("experts"), 1.0)]
    rates = _rates(drives)
    specs = [DriveSpec(d.label, r) for d, (r, _) in zip(drives, rates, strict=True)]
    layout = plan_layout({L: plan.layouts[L].file_bytes for L in plan.moe_layers}, plan.num_experts, specs, policy)
    per_drive = {d.label: {"path": d.path, "gbps": r, "measured": m, "files": 0, "bytes": 0,
                           "exists": os.path.isdir(d.path), "filesystem": mount_point(d.path)}
                 for d, (r, m) in zip(drives, rates, strict=True)}
    for L in plan.moe_layers:
        if L in layout.stripe:  # every expert is one piece per drive
            for piece in layout.stripe[L]["pieces"]:
                per_drive[drives[piece["drive"]].label]["files"] += plan.num_experts
                per_drive[drives[piece["drive"]].label]["bytes"] += piece["nbytes"] * plan.num_experts
            continue
        for row in layout.locations[L]:
            for di in row:
                per_drive[drives[di].label]["files"] += 1
                per_drive[drives[di].label]["bytes"] += plan.layouts[L].file_bytes
    for d in per_drive.values():
        d["seconds_at_rate"] = d["bytes"] / (d["gbps"] * 1e9)
    filesystems = _filesystems(drives, per_drive)
    L0 = plan.moe_layers[0] if plan.moe_layers else None
    return {
        "family": plan.family.name,
        "model_type": plan.config.get("model_type"),
        "shapes_from": plan.shapes_from,
        "expert_files": plan.expert_files,
        "moe_layers": len(plan.moe_layers),
        "experts_per_layer": plan.num_experts,
        "expert_payload_bytes": plan.layouts[L0].payload_bytes if L0 is not None else 0,
        "expert_file_bytes": plan.layouts[L0].file_bytes if L0 is not None else 0,
        "expert_bytes": plan.expert_bytes,
        "expert_formats": sorted({r.out for rs in plan.roles.values() for r in rs}),
        "trunk_bytes": plan.trunk_bytes,
        "routed_bytes_per_token": plan.routed_bytes_per_token,
        "trunk_tensors": len(plan.trunk),
        "trunk_int8_tensors": sum(t.format == "int8" for t in plan.trunk),
        "skipped_tensors": len(plan.skipped),
        "skipped_examples": sorted({n.split(".")[0] for n, _ in plan.skipped}),
        "assigned_tensors": len(ckpt.weight_map) - len(plan.skipped),
        "index_tensors": len(ckpt.weight_map),
        "per_drive": per_drive,
        "filesystems": filesystems,
        "seconds_one_pass": max((f["seconds_at_rate"] for f in filesystems.values()), default=0.0),
    }


def format_plan(r: dict) -> str:
    from deltafin import fmt

    lines = [
        f"plan for {r['model_type']} ({r['family']} family; shapes from {r['shapes_from']})",
        f"  tensors      {r['index_tensors']:,} in the index: {r['assigned_tensors']:,} assigned, "
        f"{r['skipped_tensors']:,} skipped ({', '.join(r['skipped_examples']) or 'none'})",
        f"  experts      {r['expert_files']:,} files ({r['moe_layers']} layers x {r['experts_per_layer']}), "
        f"{r['expert_payload_bytes']:,} B payload / {r['expert_file_bytes']:,} B file each, "
        f"{fmt.size(r['expert_bytes'])} ({'/'.join(r['expert_formats'])})",
        f"  trunk        {fmt.size(r['trunk_bytes'])} ({r['trunk_tensors']:,} tensors, "
        f"{r['trunk_int8_tensors']:,} int8)",
        f"  per token    {fmt.size(r['routed_bytes_per_token'])} of routed experts: at most "
        f"{25e9 / max(r['routed_bytes_per_token'], 1):.2f} tok/s at 25 GB/s of reads (none cached)",
        "  drives:",
    ]
    for label, d in r["per_drive"].items():
        lines.append(f"    {label:<8} {d['path']}{'' if d['exists'] else ' (to be created)'}  {fmt.gbps(d['gbps'])}"
                     f"{' (measured)' if d['measured'] else ''}  {d['files']:,} files  {fmt.size(d['bytes'])}")
    lines.append("  filesystems (free space and read rate counted once each):")
    for mount, f in r["filesystems"].items():
        shared = f"  drives {', '.join(f['drives'])} share it" if len(f["drives"]) > 1 else ""
        lines.append(f"    {mount}  {fmt.size(f['bytes'])} to write, {fmt.size(f['free_bytes'])} free"
                     f"{'' if f['fits'] else '  DOES NOT FIT'}  {fmt.gbps(f['gbps'])}  "
                     f"{fmt.duration(f['seconds_at_rate'])} at rate{shared}")
    lines.append(f"  one pass over all experts at the drives' rates: {fmt.duration(r['seconds_one_pass'])} "
                 f"(the slowest filesystem's share / its rate)")
    return "\n".join(lines)
