"""pack, verify, inspect."""

from __future__ import annotations

import os
import sys

from deltafin.errors import UsageError

MAX_IO_THREADS = 256  # reads in flight for verify: past this, threads cost memory and gain nothing


def run(args) -> int:
    return {"pack": _pack, "verify": _verify, "inspect": _inspect}[args.command](args)


def _write_json(path: str | None, doc: dict) -> None:
    if path:
        from deltafin.store.manifest import write_json_atomic

        write_json_atomic(os.path.abspath(path), doc)


def _pack(args) -> int:
    from deltafin.interfaces.paths import resolve_checkpoint
    from deltafin.store.drives import parse_drives, require_drives, shared_filesystems, shared_warning

    args.src = resolve_checkpoint(args.src)
    drives = parse_drives(args.drive)
    require_drives(drives, args.create, plan=args.plan)
    for group in shared_filesystems(drives):
        print(f"[deltafin] warning: {shared_warning(group)}", file=sys.stderr)
    if args.plan:
        return _plan(args, drives)
    if not args.out:
        raise UsageError("deltafin pack SRC OUT: OUT (the model folder to write) is missing; or use --plan")
    from deltafin.store.pack import PackOptions, pack

    opts = PackOptions(args.experts, args.trunk, args.placement, args.model_id, args.repair, not args.no_progress,
                       args.trace, args.spare_gb, args.allow_nonfinite, getattr(args, "overwrite", False),
                       args.allow_unused)
    s = pack(args.src, args.out, drives, opts)
    from deltafin.store.catalog import record

    record(s.out, s.model_id)
    from deltafin import fmt

    if s.moved is not None:
        print(f"{s.out}: already packed; moved only what the new drive rates or placement need: copied "
              f"{s.moved[0]:,} expert files ({fmt.size(s.bytes_written)}), deleted {s.moved[1]:,}, kept "
              f"{s.skipped:,} in place, in {fmt.duration(s.seconds)}")
    else:
        print(f"packed {s.out}: {s.expert_files:,} expert files ({s.written:,} written, {s.skipped:,} already there"
              + (f", {s.repaired} repaired" if s.repaired else "") + f"), {fmt.size(s.expert_bytes)} experts, "
              f"{fmt.size(s.trunk_bytes)} trunk")
        print(f"  wrote {fmt.size(s.bytes_written)} in {fmt.duration(s.seconds)} ({fmt.gbps(s.write_gbps)}); "
              f"peak RSS {fmt.size(s.peak_rss_bytes)}")
    if s.removed:
        print(f"  removed {s.removed:,} expert files of the layout or model this pack replaced")
    for label, d in s.per_drive.items():
        print(f"  {label:<8} {d['path']}  {fmt.gbps(d['gbps'])}  {d['files']:,} files  {fmt.size(d['bytes'])}")
    _write_json(args.json, {k: getattr(s, k) for k in s.__dataclass_fields__} | {"write_gbps": s.write_gbps})
    return 0


def _plan(args, drives) -> int:
    from deltafin.store.checkpoint import Checkpoint
    from deltafin.store.plan_report import format_plan, plan_report

    rep = plan_report(Checkpoint(args.src), drives, args.experts, args.trunk, args.placement)
    print(format_plan(rep))
    _write_json(args.json, rep)
    return 0


def _open(args):
    from deltafin.interfaces.paths import resolve_packed
    from deltafin.store.manifest import parse_drive_map
    from deltafin.store.model_dir import PackedModel

    return PackedModel.open(resolve_packed(args.model), parse_drive_map(args.drive_map))


def _verify(args) -> int:
    from deltafin.progress import bar as progress_bar
    from deltafin.store.verify import repair_hint, verify

    if not 1 <= args.io_threads <= MAX_IO_THREADS:
        raise UsageError(f"--io-threads {args.io_threads}: give 1 to {MAX_IO_THREADS} reader threads (default 4)")
    model = _open(args)
    total = sum(model.file_bytes(L) * model.num_experts for L in model.moe_layers)
    with progress_bar(total, "verify") as bar:
        rep = verify(model, args.io_threads, bar.update)
    from deltafin import fmt

    print(f"verified {rep.files:,} expert files and {rep.trunk_files} trunk files, {fmt.size(rep.bytes)} in "
          f"{fmt.duration(rep.seconds)} ({fmt.rate(rep.bytes / max(rep.seconds, 1e-9))}): "
          + ("all good" if rep.ok else f"{len(rep.bad)} bad"))
    for path, problem in rep.bad:
        print(f"  BAD {path}: {problem}", file=sys.stderr)
    if not rep.ok:
        print(f"fix: {repair_hint(model)}  (rewrites only the bad files)", file=sys.stderr)
    _write_json(args.json, {"files": rep.files, "bytes": rep.bytes, "seconds": rep.seconds,
                            "bad": [{"path": p, "problem": q} for p, q in rep.bad]})
    return 0 if rep.ok else 1


def _inspect(args) -> int:
    from deltafin.interfaces.paths import resolve_checkpoint
    from deltafin.store.catalog import find
    from deltafin.store.inspect import format_summary, model_summary, plan_summary
    from deltafin.store.manifest import MANIFEST

    if not os.path.exists(args.model) and find(args.model) is None:
        args.model = resolve_checkpoint(args.model)

    if not os.path.exists(os.path.join(args.model, MANIFEST)) and os.path.exists(
            os.path.join(args.model, "config.json")):
        s = plan_summary(args.model)  # a checkpoint, not packed yet: project from its config and index
    else:
        s = model_summary(_open(args))
    print(format_summary(s))
    _write_json(args.json, s)
    return 0
