"""``deltafin bench drives``: decode with each placement policy on emulated drives shaped like the M5 Max write-up's.

The drive set is ``report4`` (internal 7 GB/s + three 6 GB/s Thunderbolt 5 enclosures) scaled to what this
machine moves: the emulated drives serve real bytes from this one disk, so its direct read rate is measured
first and the set is scaled to 0.8 of it (the real disk must never be what limits the emulated ones).

One synthetic model with Kimi K3's expert size (``write_synthetic``) is re-placed for each policy with
``deltafin place`` (moving only what must move) and decoded I/O-only through the real engine read path
(``StreamingExperts``: scheduled reads, per-drive reader threads, striped pieces reassembled), cold cache,
seeded uniform routing (Kimi K3's router is trained for flat expert use). Each figure is reported beside
the summed read rate of the emulated drives; target: the best policy uses >= 0.90 of it.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time

from deltafin.bench.disk import raw_read_gbps
from deltafin.bench.synthetic import write_synthetic

POLICIES = ("bandwidth", "coactivation", "replicas", "stripe-bandwidth", "stripe-equal", "one-drive")
LABELS = {
    "one-drive": "one drive alone (internal)",
    "stripe-equal": "stripe-equal (RAID-0)",
    "bandwidth": "bandwidth (whole files)",
    "coactivation": "coactivation (whole files)",
    "replicas": "replicas (whole files + copies)",
    "stripe-bandwidth": "stripe-bandwidth",
}
TARGET = 0.90
HEADROOM = 0.8  # emulated summed rate / this disk's measured rate


def _policies(arg: str | None) -> list[str]:
    from deltafin.errors import UsageError

    if not arg:
        return list(POLICIES)
    got = [p.strip() for p in arg.split(",") if p.strip()]
    bad = [p for p in got if p not in POLICIES]
    if bad or not got:
        raise UsageError(f"--policies {arg!r}: choose from {', '.join(POLICIES)}")
    return [p for p in POLICIES if p in got]  # fewest moves between consecutive layouts


def _routes(layers: list[int], experts: int, k: int, tokens: int, seed: int) -> list[dict[int, list[int]]]:
    from deltafin.errors import UsageError

    if not 0 < k <= experts:
        raise UsageError(f"--k {k}: need 0 < k <= --experts ({experts})")
    rng = random.Random(seed)
    return [{L: sorted(rng.sample(range(experts), k)) for L in layers} for _ in range(tokens)]


def _write_trace(path: str, model_id: str, experts: int, routes: list[dict[int, list[int]]]) -> str:
    from deltafin.io.routes import RouteWriter

    w = RouteWriter(path, model_id, experts, sorted(routes[0]))
    for tok in routes:
        w.write(sorted(tok.items()))
    w.close()
    return path


def _layout(pm, policy: str, trace: str, spare_gb: float | None) -> float:
    """Re-place the model for ``policy``; returns the seconds the move took."""
    from deltafin.store.place import Layout, apply_layout, place_model

    t0 = time.perf_counter()
    if policy == "one-drive":  # every expert on drive 0, the internal one
        apply_layout(pm, Layout("one-drive", {L: [[0] for _ in range(pm.num_experts)] for L in pm.moe_layers}))
    else:
        place_model(pm.path, policy, trace_path=trace, spare_gb=spare_gb)
    return time.perf_counter() - t0


def _decode(pm, spec: str, threads: int, routes) -> dict:
    """Decode ``routes`` I/O-only through StreamingExperts on emulated drives; timings per layer."""
    from deltafin.io.emulator import emulated_readers
    from deltafin.runtime.source import StreamingExperts

    readers = emulated_readers(spec, pm)
    source = StreamingExperts(pm, cache_bytes=0, threads=threads, readers=readers)
    spans = []
    try:
        t0 = time.perf_counter()
        for step in routes:
            for L, ids in step.items():
                t = time.perf_counter()
                for _ in source.fetch(L, ids):
                    pass
                spans.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0
    finally:
        source.close()
    late = sum(r.stats()["late_s"] for r in readers)
    reads = sum(r.stats()["reads"] for r in readers)
    return {"seconds": wall, "bytes_read": source.stats.bytes_read, "layer_spans": spans,
            "late_ms_per_read": 1e3 * late / max(reads, 1), "per_drive": source.per_drive()}


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def run(args) -> dict:
    from deltafin.io.emulator import format_spec, parse_spec
    from deltafin.store.model_dir import PackedModel

    policies = _policies(args.policies)
    base = parse_spec(args.spec)
    work = tempfile.mkdtemp(prefix="deltafin-bench-drives-", dir=args.dir)
    try:
        drives = [(m.label, os.path.join(work, m.label), m.gbps) for m in base]
        t0 = time.perf_counter()
        root = write_synthetic(os.path.join(work, "model"), drives, args.layers, args.experts, seed=args.seed)
        write_s = time.perf_counter() - t0
        pm = PackedModel.open(root)
        nbytes = pm.file_bytes(pm.moe_layers[0])
        paths = [f.path for L in pm.moe_layers for e in range(pm.num_experts) for f in pm.expert_files(L, e)]
        random.Random(args.seed).shuffle(paths)
        raw = raw_read_gbps(paths[:32], nbytes, 8)  # this disk: what the emulated drives read from
        summed_base = sum(m.gbps for m in base)
        scale = args.scale or HEADROOM * raw / summed_base
        spec = format_spec(base) + f"@{scale:.6g}"
        models = parse_spec(spec)
        summed = sum(m.gbps for m in models)
        routes = _routes(pm.moe_layers, pm.num_experts, args.k, args.tokens, args.seed)
        trace = _write_trace(os.path.join(work, "routes.jsonl"), pm.model_id, pm.num_experts,
                             _routes(pm.moe_layers, pm.num_experts, args.k, 256, args.seed + 1))
        results = {}
        for policy in policies:
            move_s = _layout(pm, policy, trace, None)
            pm = PackedModel.open(root)
            r = _decode(pm, spec, args.threads, routes)
            results[policy] = _figures(r, policy, args, summed, models[0].gbps, nbytes, move_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    best = max((p for p in results if p != "one-drive"), key=lambda p: results[p]["aggregate_fraction"],
               default=policies[0])
    rec = {
        "bench": "drives", "spec": spec, "scale": scale, "summed_GBps": summed, "raw_disk_GBps": raw,
        "drives": [{"label": m.label, "GBps": m.gbps} for m in models], "moe_layers": args.layers,
        "experts": args.experts, "k": args.k, "tokens": args.tokens, "threads": args.threads,
        "expert_file_bytes": nbytes, "write_s": write_s, "policies": results,
        "best": {"policy": best, **results[best]}, "target": TARGET,
    }
    _print(rec)
    if args.json:
        from deltafin.store.manifest import write_json_atomic

        write_json_atomic(args.json, rec)
    return rec


def _figures(r: dict, policy: str, args, summed: float, internal: float, nbytes: int, move_s: float) -> dict:
    gbps = r["bytes_read"] / r["seconds"] / 1e9
    layer_bytes = args.k * nbytes
    return {
        "tok_s": args.tokens / r["seconds"], "read_GBps": gbps, "aggregate_fraction": gbps / summed,
        "own_fraction": gbps / (internal if policy == "one-drive" else summed),
        "layer_ms_p50": 1e3 * _pct(r["layer_spans"], 0.5), "layer_ms_p99": 1e3 * _pct(r["layer_spans"], 0.99),
        "layer_ideal_ms": 1e3 * layer_bytes / ((internal if policy == "one-drive" else summed) * 1e9),
        "late_ms_per_read": r["late_ms_per_read"], "bytes_read": r["bytes_read"], "seconds": r["seconds"],
        "place_s": move_s, "per_drive": r["per_drive"],
    }


def _print(rec: dict) -> None:
    drives = ", ".join(f"{d['label']} {d['GBps']:.3f}" for d in rec["drives"])
    print(f"bench drives: emulated drives shaped like the M5 Max write-up's ({drives} GB/s; summed "
          f"{rec['summed_GBps']:.3f} GB/s = {HEADROOM:g} x this disk's raw direct read rate {rec['raw_disk_GBps']:.3f} "
          f"GB/s measured here, because the emulated drives serve real bytes from this one disk); synthetic model "
          f"{rec['moe_layers']} layers x {rec['experts']} experts of {rec['expert_file_bytes'] / 1e6:.2f} MB, "
          f"{rec['k']} routed per token, {rec['tokens']} tokens, cold cache, I/O only (expert math skipped)")
    print(f"  {'policy':34s} {'tok/s':>7s} {'GB/s':>7s} {'of summed':>9s} {'layer p50/p99 ms':>17s} {'ideal ms':>8s}")
    for p, r in rec["policies"].items():
        own = f" ({r['own_fraction']:.2f} of its own rate)" if p == "one-drive" else ""
        print(f"  {LABELS[p]:34s} {r['tok_s']:7.3f} {r['read_GBps']:7.3f} {r['aggregate_fraction']:9.2f} "
              f"{r['layer_ms_p50']:8.0f}/{r['layer_ms_p99']:<8.0f} {r['layer_ideal_ms']:8.0f}{own}")
    b = rec["best"]
    line = (f"best: {b['policy']} uses {b['aggregate_fraction']:.2f} of the summed read rate (target >= {TARGET:.2f}): "
            f"{b['tok_s']:.3f} tok/s")
    pol = rec["policies"]
    if "one-drive" in pol:
        line += f"; one drive alone {pol['one-drive']['tok_s'] / b['tok_s']:.2f}x of that"
    if "stripe-equal" in pol:
        line += f"; RAID-0 {pol['stripe-equal']['tok_s'] / b['tok_s']:.2f}x"
    print(line)
