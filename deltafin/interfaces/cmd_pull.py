"""``deltafin pull REPO OUT``: download a Hugging Face checkpoint and pack it as its shards land."""

from __future__ import annotations

import argparse
import os
import sys

from deltafin.errors import UsageError


def add_pull_args(p) -> None:
    p.add_argument("repo", help="Hugging Face repo id, e.g. Qwen/Qwen3-30B-A3B (HF_ENDPOINT picks the server)")
    p.add_argument("out", nargs="?", help="model folder to write (not needed with --plan)")
    p.add_argument("--drive", action="append", default=[], metavar="[LABEL:]PATH[=GBPS]",
                   help="expert drive root, repeatable, as for 'deltafin pack'")
    p.add_argument("--revision", help="branch, tag or commit (default: main)")
    p.add_argument("--token", default=None,
                   help="Hugging Face token for gated or private repos (default: HF_TOKEN or the saved login)")
    p.add_argument("--source-dir", metavar="DIR", help="where the shards are downloaded (default: OUT/source)")
    p.add_argument("--delete-source", action="store_true",
                   help="remove each shard once all its tensors are packed and read back: the disk holds the pack "
                        "plus a few shards, not the whole checkpoint as well")
    p.add_argument("--window", type=int, default=2,
                   help="with --delete-source: shards downloaded ahead of the packer")
    p.add_argument("--plan", action="store_true",
                   help="print what would be downloaded and written, and the peak disk; no weights are downloaded")
    p.add_argument("--experts", default="auto", choices=["auto", "mxfp4", "bf16", "f32"],
                   help="expert format, as for 'deltafin pack'")
    p.add_argument("--trunk", default="int8", choices=["int8", "bf16"], help="resident trunk format")
    p.add_argument("--placement", default="bandwidth", help="expert placement, as for 'deltafin pack'")
    p.add_argument("--model-id", help="folder name of this model on the drives (default: OUT's name)")
    p.add_argument("--create", action="store_true", help="create --drive folders that do not exist")
    p.add_argument("--allow-nonfinite", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", metavar="PATH", help="write the plan or summary as JSON")
    p.add_argument("--no-progress", action="store_true")


def run(args) -> int:
    from deltafin import fmt
    from deltafin.store.drives import parse_drives, require_drives
    from deltafin.store.pack import PackOptions
    from deltafin.store.pull import PullOptions, plan_pull, pull

    if not args.plan and not args.out:
        raise UsageError("deltafin pull REPO OUT: OUT (the model folder to write) is missing; or use --plan")
    if args.window < 1:
        raise UsageError(f"--window {args.window}: shards fetched ahead must be 1 or more, e.g. --window 2")
    drives = parse_drives(args.drive)
    require_drives(drives, args.create, plan=args.plan)
    opts = PullOptions(args.revision, args.token, args.source_dir, args.delete_source, args.window,
                       not args.no_progress)
    pack_opts = PackOptions(args.experts, args.trunk, args.placement, args.model_id, progress=not args.no_progress,
                            allow_nonfinite=args.allow_nonfinite)
    if args.plan:
        import tempfile

        src = args.source_dir or (os.path.join(args.out, "source") if args.out else tempfile.mkdtemp("-deltafin-plan"))
        rep = plan_pull(args.repo, src, pack_opts, opts, drives)
        print(f"{args.repo} at {rep['commit'][:12]}: {rep['shards']} shards, {fmt.size(rep['source_bytes'])} to "
              f"download (largest shard {fmt.size(rep['largest_shard_bytes'])})")
        print(f"  the pack: {fmt.size(rep['expert_bytes'])} of experts over {max(len(drives), 1)} drive(s) + "
              f"{fmt.size(rep['trunk_bytes'])} trunk = {fmt.size(rep['pack_bytes'])}")
        print(f"  peak disk with --delete-source (--window {rep['window']}): about "
              f"{fmt.size(rep['peak_bytes_delete_source'])}; keeping the source: {fmt.size(rep['peak_bytes_keep_source'])}")
        _json(args.json, rep)
        return 0
    s = pull(args.repo, args.out, drives, pack_opts, opts)
    from deltafin.store.catalog import record

    record(s.pack.out, s.pack.model_id)
    print(f"pulled {args.repo} at {s.commit[:12]}: {s.shards} shards ({fmt.size(s.source_bytes)}), {s.downloaded} "
          f"downloaded in this run; packed {s.pack.expert_files:,} expert files into {s.pack.out} in "
          f"{fmt.duration(s.seconds)}")
    if args.delete_source:
        print(f"  {s.removed} shards removed after read-back; at most {fmt.size(s.peak_source_bytes)} of shards "
              f"were on disk at once")
    print(f"next: deltafin run {s.pack.out} -p 'hello'   (or: deltafin chat / deltafin serve {s.pack.out})")
    _json(args.json, {k: getattr(s, k) for k in s.__dataclass_fields__ if k != "pack"})
    return 0


def _json(path, doc) -> None:
    if path:
        from deltafin.store.manifest import write_json_atomic

        write_json_atomic(os.path.abspath(path), doc)
    sys.stdout.flush()
