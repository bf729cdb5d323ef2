"""Several drives: ``deltafin place``, ``deltafin simulate`` and ``deltafin bench drives``.

Argument builders import nothing heavy (``deltafin --help`` stays instant); the work is imported lazily.
"""

from __future__ import annotations

import os
import sys

from deltafin.errors import UsageError

POLICIES = ("bandwidth", "coactivation", "replicas", "roundrobin", "stripe-bandwidth", "stripe-equal")


def add_place_args(p) -> None:
    p.add_argument("model", help="packed model folder")
    p.add_argument("--policy", required=True, choices=POLICIES,
                   help="bandwidth: whole files balanced by read rate per layer; coactivation: also keep experts "
                        "routed together apart (needs --trace); replicas: coactivation plus copies of the most-used "
                        "experts on spare space (needs --trace); roundrobin: equal counts; stripe-bandwidth: every "
                        "expert cut into one piece per drive sized by read rate; stripe-equal: equal pieces (RAID-0)")
    p.add_argument("--trace", metavar="ROUTES.jsonl", help="routing trace from 'deltafin run --record-routes'")
    p.add_argument("--spare-gb", type=float, default=None,
                   help="replicas: GB per drive the extra copies may use (default: a tenth of the drive's share)")
    p.add_argument("--drive-map", action="append", metavar="LABEL=PATH", help="drive LABEL is now mounted at PATH")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    p.add_argument("--no-progress", action="store_true")


def add_simulate_args(p) -> None:
    p.add_argument("--drives", default="report4", metavar="SPEC",
                   help="the drive set of the base scenarios (--emulate-drives grammar; default report4: internal "
                        "7 GB/s + three 6 GB/s Thunderbolt 5 enclosures, the original report's machine)")
    p.add_argument("--tokens", type=int, default=8, help="decoded tokens per scenario")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens for time to first token (0: skip)")
    p.add_argument("--cache-gb", default="16,32,64", help="expert cache sizes to simulate, comma-separated")
    p.add_argument("--layers", type=int, default=None, help="simulate only this many MoE layers (quick looks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plots", metavar="DIR", help="write PNG scaling curves here (needs the 'plot' extra)")
    p.add_argument("--crosscheck", action="store_true",
                   help="also run the emulator (real bytes, modelled drives) on the same configurations, scaled "
                        "down to what this machine moves, and report the agreement")
    p.add_argument("--crosscheck-gbps", type=float, default=1.0,
                   help="summed read rate the report's drives are scaled to for --crosscheck (default 1 GB/s)")
    p.add_argument("--json", metavar="PATH", help="write every record as JSON")


def add_bench_drives_args(sub) -> None:
    b = sub.add_parser("drives", help="decode with each placement policy on emulated drives shaped like the "
                                      "report's, beside their summed read rate")
    b.set_defaults(module="cmd_drives")
    b.add_argument("--spec", default="report4", help="emulated drive set before scaling (default report4)")
    b.add_argument("--scale", type=float, default=None,
                   help="rate scale of the emulated drives (default: 0.8 x this disk's measured direct read rate / "
                        "the set's summed rate, so the real disk serving the bytes is never the bottleneck)")
    b.add_argument("--layers", type=int, default=4, help="MoE layers of the synthetic K3-expert-size model")
    b.add_argument("--experts", type=int, default=32, help="experts per layer")
    b.add_argument("--k", type=int, default=16, help="experts routed per token per layer")
    b.add_argument("--tokens", type=int, default=4, help="decoded tokens per policy")
    b.add_argument("--threads", type=int, default=8, help="reader threads per drive")
    b.add_argument("--policies", default=None,
                   help="comma-separated subset of: one-drive, stripe-equal, bandwidth, coactivation, replicas, "
                        "stripe-bandwidth (default: all)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--dir", default=None, help="scratch folder on the disk that serves the bytes")
    b.add_argument("--json", metavar="PATH")


def run(args) -> int:
    if args.command == "place":
        return _place(args)
    if args.command == "simulate":
        return _simulate(args)
    if args.command == "bench" and args.bench == "drives":
        from deltafin.bench.drives import run as bench_drives

        rec = bench_drives(args)
        return 0 if rec["best"]["aggregate_fraction"] >= 0.9 else 1
    raise AssertionError(args.command)


def _write_json(path: str | None, doc) -> None:
    if path:
        from deltafin.store.manifest import write_json_atomic

        write_json_atomic(os.path.abspath(path), doc)


def _place(args) -> int:
    from deltafin import fmt
    from deltafin.interfaces.paths import resolve_packed
    from deltafin.store.manifest import parse_drive_map
    from deltafin.store.place import place_model

    args.model = resolve_packed(args.model)
    rep = place_model(args.model, args.policy, trace_path=args.trace, spare_gb=args.spare_gb,
                      drive_map=parse_drive_map(args.drive_map), progress=not args.no_progress)
    if rep.resumed:
        print("finished an interrupted placement change first")
    if not rep.experts_changed:
        print(f"{args.model}: already placed by {args.policy}; nothing moved")
    else:
        print(f"placed {args.model} by {args.policy}: {rep.experts_changed:,} experts changed; copied "
              f"{rep.files_copied:,} files ({fmt.size(rep.bytes_copied)}), kept {rep.files_kept:,} already there, "
              f"deleted {rep.files_deleted:,} ({fmt.size(rep.bytes_deleted)}) in {fmt.duration(rep.seconds)}")
    for label, d in rep.per_drive.items():
        print(f"  {label:<8} {d['path']}  {fmt.gbps(d['gbps'])}  {d['files']:,} files  {fmt.size(d['bytes'])}")
    _write_json(args.json, {k: getattr(rep, k) for k in rep.__dataclass_fields__})
    return 0


def _simulate(args) -> int:
    from dataclasses import replace

    from deltafin import fmt
    from deltafin.io.emulator import parse_spec
    from deltafin.sim import KIMI_K3, format_table, run_scenarios, scaling_curves, write_plots

    try:
        cache_gb = tuple(float(x) for x in args.cache_gb.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--cache-gb {args.cache_gb!r}: expected comma-separated GB, e.g. 16,32,64") from None
    if args.tokens < 1 or args.prompt < 0 or (args.layers is not None and args.layers < 1):
        raise UsageError("--tokens and --layers must be >= 1 and --prompt >= 0")
    shape = KIMI_K3 if args.layers is None else replace(KIMI_K3, name=f"kimi-k3 ({args.layers} layers)",
                                                        layers=args.layers)
    drives = parse_spec(args.drives)
    print(f"simulating {shape.name}: {shape.layers} MoE layers x {shape.experts} experts of "
          f"{fmt.size(shape.expert_bytes)}, {shape.top_k} routed per token ({fmt.size(shape.bytes_per_token)} "
          f"per token uncached); base drives {args.drives} ({fmt.gbps(sum(d.gbps for d in drives))} summed)",
          file=sys.stderr)
    records = run_scenarios(shape, tokens=args.tokens, prompt=args.prompt, seed=args.seed, drives=drives,
                            cache_gb=cache_gb)
    print(format_table(records))
    print("bound: tok/s if every drive read at its rate all the time (summed rate / bytes read per token); "
          "used: the fraction of the summed read rate decode achieved; p50/p99: per-layer read makespan")
    out = {"model": shape.name, "scenarios": records}
    if args.plots:
        curves = scaling_curves(shape, tokens=min(args.tokens, 4), seed=args.seed)
        paths = write_plots(curves, args.plots)
        out["curves"] = curves
        print("plots: " + (", ".join(paths) if paths else "none (matplotlib missing: pip install 'deltafin[plot]')"))
    if args.crosscheck:
        out["crosscheck"] = _crosscheck(shape, drives, args)
    _write_json(args.json, out)
    return 0


def _crosscheck(shape, drives, args) -> list[dict]:
    from deltafin.sim.emulated import crosscheck_scenarios

    rows = crosscheck_scenarios(shape, drives, summed_gbps=args.crosscheck_gbps, seed=args.seed)
    print(f"\ncross-check: the same configurations through the emulator (real bytes from memory, modelled drives), "
          f"{rows[0]['layers'] if rows else 0} layers, rates scaled so the report's drives sum to "
          f"{args.crosscheck_gbps:g} GB/s")
    print(f"{'scenario':52s} {'sim tok/s':>9s} {'emu tok/s':>9s} {'emu/sim':>7s}")
    for r in rows:
        print(f"{r['name'][:52]:52s} {r['sim_tok_s']:9.3f} {r['emulated_tok_s']:9.3f} {r['ratio']:7.3f}"
              f"{'' if abs(r['ratio'] - 1) <= 0.1 else '  (outside 10%)'}")
    inside = sum(abs(r["ratio"] - 1) <= 0.1 for r in rows)
    print(f"agreement: {inside} of {len(rows)} within 10% (target: all)")
    return rows
