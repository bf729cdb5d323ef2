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
    p.add_argument("--policy", choices=POLICIES,
                   help="bandwidth: whole files balanced by read rate per layer; coactivation: also keep experts "
                        "routed together apart (needs --trace); replicas: coactivation plus copies of the most-used "
                        "experts on spare space (needs --trace); roundrobin: equal counts; stripe-bandwidth: every "
                        "expert cut into one piece per drive sized by read rate; stripe-equal: equal pieces (RAID-0)")
    p.add_argument("--ranks", metavar="SPEC",
                   help="own the experts over the ranks of a cluster (torchrun): 'd0,d1@64;d2,d3@64' gives rank 0 drives "
                        "d0,d1 and 64 GB of memory for cached experts, rank 1 d2,d3 and 64 GB ('2@64': drives dealt "
                        "out in order); ownership follows memory first, then drive read rate")
    p.add_argument("--trace", metavar="ROUTES.jsonl", help="routing trace from 'deltafin run --record-routes'")
    p.add_argument("--spare-gb", type=float, default=None,
                   help="replicas: GB per drive the extra copies may use (default: a tenth of the drive's share)")
    p.add_argument("--drive-map", action="append", metavar="LABEL=PATH", help="drive LABEL is now mounted at PATH")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    p.add_argument("--no-progress", action="store_true")


def add_simulate_args(p) -> None:
    p.add_argument("--drives", default="report4", metavar="SPEC",
                   help="the drive set of the base scenarios (--emulate-drives grammar; default report4: internal "
                        "7 GB/s + three 6 GB/s Thunderbolt 5 enclosures, the machine of the public Kimi K3 write-up on an M5 Max 128 GB at 1.00 tok/s)")
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
                   help="summed read rate the M5 Max write-up's drives are scaled to for --crosscheck (default 1 GB/s)")
    p.add_argument("--json", metavar="PATH", help="write every record as JSON")
    c = p.add_argument_group("cluster (expert parallel over machines; --cluster runs only this projection)")
    c.add_argument("--cluster", action="store_true",
                   help="project Kimi K3 over N machines: tok/s and time to first token per machine count and network")
    c.add_argument("--machines", default="1,2,4,8,12", help="machine counts, comma-separated")
    c.add_argument("--net-gbit", default="10,100", help="network link rates in Gb/s, comma-separated")
    c.add_argument("--hop-us", type=float, default=25.0, help="latency per step of a collective, us (assumed 25)")
    c.add_argument("--machine-gb", type=float, default=128.0, help="memory per machine, GB")
    c.add_argument("--mem-gbps", type=float, default=200.0, help="memory bandwidth per machine, GB/s (assumed 200)")


def add_bench_drives_args(sub) -> None:
    b = sub.add_parser("drives", help="decode with each placement policy on emulated drives shaped like the "
                                      "M5 Max write-up's, beside their summed read rate")
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

    if (args.policy is None) == (args.ranks is None):
        raise UsageError("give one of --policy P (placement over drives) or --ranks SPEC (ownership over ranks)")
    args.model = resolve_packed(args.model)
    rep = place_model(args.model, args.policy, trace_path=args.trace, spare_gb=args.spare_gb,
                      drive_map=parse_drive_map(args.drive_map), progress=not args.no_progress, ranks=args.ranks)
    if args.ranks is not None:
        _print_ranks(args.model)
    if rep.resumed:
        print("finished an interrupted placement change first")
    if not rep.experts_changed:
        print(f"{args.model}: already placed by {rep.policy}; nothing moved")
    else:
        print(f"placed {args.model} by {rep.policy}: {rep.experts_changed:,} experts changed; copied "
              f"{rep.files_copied:,} files ({fmt.size(rep.bytes_copied)}), kept {rep.files_kept:,} already there, "
              f"deleted {rep.files_deleted:,} ({fmt.size(rep.bytes_deleted)}) in {fmt.duration(rep.seconds)}; "
              f"{rep.files_verified:,} files of the new layout read back and matched their checksums before "
              f"any delete")
    for label, d in rep.per_drive.items():
        print(f"  {label:<8} {d['path']}  {fmt.gbps(d['gbps'])}  {d['files']:,} files  {fmt.size(d['bytes'])}")
    _write_json(args.json, {k: getattr(rep, k) for k in rep.__dataclass_fields__})
    return 0


def _print_ranks(model: str) -> None:
    from deltafin.store.manifest import load

    ex = load(model)["experts"]
    rk = ex["ranks"]
    for r, ent in enumerate(rk["ranks"]):
        n = sum(o == r for own in rk["owner"].values() for o in own)
        print(f"  rank {r}: drives {','.join(ent['drives'])}  {ent['cache_gb']:g} GB for experts  owns {n:,} experts "
              f"({n / max(len(rk['owner']), 1):.1f} per layer)")


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
    if args.cluster:
        return _simulate_cluster(args)
    shape = KIMI_K3 if args.layers is None else replace(KIMI_K3, name=f"kimi-k3 ({args.layers} layers)",
                                                        layers=args.layers)
    drives = parse_spec(args.drives)
    print(f"simulating {shape.name}: {shape.layers} MoE layers x {shape.experts} experts of "
          f"{fmt.size(shape.expert_bytes)}, {shape.top_k} routed per token ({fmt.size(shape.bytes_per_token)} "
          f"per token uncached); base drives {args.drives} ({fmt.gbps(sum(d.gbps for d in drives))} summed)",
          file=sys.stderr)
    from deltafin.progress import bar
    from deltafin.sim.scenarios import scenario_configs

    n = len(scenario_configs(shape, tokens=args.tokens, prompt=args.prompt, seed=args.seed, drives=drives,
                             cache_gb=cache_gb))
    with bar(n, "simulate", unit="scenario") as b:
        records = run_scenarios(shape, tokens=args.tokens, prompt=args.prompt, seed=args.seed, drives=drives,
                                cache_gb=cache_gb, on_done=b.update)
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


def _numbers(text: str, flag: str, kind=float) -> tuple:
    try:
        vals = tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        vals = ()
    if not vals or min(vals) <= 0:
        raise UsageError(f"{flag} {text!r}: expected positive comma-separated numbers, e.g. {flag} 1,2,4")
    return vals


def _simulate_cluster(args) -> int:
    from dataclasses import replace

    from deltafin.io.emulator import parse_spec
    from deltafin.sim import KIMI_K3
    from deltafin.sim.cluster import K3_TRUNK_GB, Machine, cluster_table, format_cluster, plot_cluster

    shape = KIMI_K3 if args.layers is None else replace(KIMI_K3, layers=args.layers)
    machine = Machine(args.machine_gb, parse_spec(args.drives), args.mem_gbps)
    if K3_TRUNK_GB + machine.reserve_gb >= machine.memory_gb:
        raise UsageError(f"--machine-gb {args.machine_gb:g}: a machine must hold the {K3_TRUNK_GB} GB int8 trunk "
                         f"and {machine.reserve_gb:g} GB of headroom")
    print(f"simulating {shape.name} expert-parallel: machines of {machine.memory_gb:g} GB ({K3_TRUNK_GB} GB int8 "
          f"trunk on each, {machine.reserve_gb:g} GB headroom, the rest caches owned experts), drives {args.drives} "
          f"({sum(d.gbps for d in machine.drives):.1f} GB/s) each, {machine.mem_gbps:g} GB/s memory, "
          f"{args.hop_us:g} us per collective step", file=sys.stderr)
    from deltafin.progress import bar

    counts, nets = _numbers(args.machines, "--machines", int), _numbers(args.net_gbit, "--net-gbit")
    with bar(len(counts) * len(nets), "simulate", unit="cluster") as b:
        recs = cluster_table(counts, nets, machine, args.hop_us, args.tokens, args.prompt, args.seed, shape,
                             on_done=b.update)
    print(format_cluster(recs))
    print("cached: share of all experts resident in the machines' memory; bound: tok/s with every drive reading "
          "all the time, one machine's memory pass and the network (max of the first two, plus the third); TTFT: "
          "first prompt, cold caches")
    out = {"model": shape.name, "cluster": recs}
    if args.plots:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise UsageError("--plots needs matplotlib: pip install 'deltafin[plot]'") from None
        os.makedirs(args.plots, exist_ok=True)
        print("plots: " + ", ".join(plot_cluster(recs, args.plots, plt)))
    _write_json(args.json, out)
    return 0


def _crosscheck(shape, drives, args) -> list[dict]:
    from deltafin.sim.emulated import crosscheck_scenarios

    rows = crosscheck_scenarios(shape, drives, summed_gbps=args.crosscheck_gbps, seed=args.seed)
    print(f"\ncross-check: the same configurations through the emulator (real bytes from memory, modelled drives), "
          f"{rows[0]['layers'] if rows else 0} layers, rates scaled so the M5 Max write-up's drives sum to "
          f"{args.crosscheck_gbps:g} GB/s")
    print(f"{'scenario':52s} {'sim tok/s':>9s} {'emu tok/s':>9s} {'emu/sim':>7s}")
    for r in rows:
        print(f"{r['name'][:52]:52s} {r['sim_tok_s']:9.3f} {r['emulated_tok_s']:9.3f} {r['ratio']:7.3f}"
              f"{'' if abs(r['ratio'] - 1) <= 0.1 else '  (outside 10%)'}")
    inside = sum(abs(r["ratio"] - 1) <= 0.1 for r in rows)
    print(f"agreement: {inside} of {len(rows)} within 10% (target: all)")
    return rows
