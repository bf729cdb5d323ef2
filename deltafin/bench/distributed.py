"""``deltafin bench distributed``: expert-parallel decode over several processes, beside its bounds.

A synthetic model with Kimi K3's expert size (no trunk) is owned over the ranks (``store/ranks.py``), each
rank reading only its own emulated drives (``--spec``, split between the ranks in order; the bytes of its
expert files are loaded into memory first and served at the modelled rates, so the one real disk under
all of them never sets the pace). Every rank runs
the real MoE path (``models/base.moe_dispatch`` through ``runtime/distributed.DistributedExperts``): the
same seeded routing, its owned experts read and computed, one all-reduce of the [1, k, latent] slot buffer
per layer. Figures, each beside its limit from the same run:

- decode tok/s against the bound set by the slower rank's reads: per layer, max over ranks of (bytes of
  its routed experts / its drives' summed rate), summed over layers and tokens;
- per-layer collective time in the step (which includes waiting for the slower rank) beside the bare
  all-reduce of the same buffer timed alone afterwards;
- with ``--resident`` (GPU: every owned expert cached on the device after one warm pass) and ``--worlds 1,2``,
  tok/s over N ranks against one rank, beside the ideal N x.

Launched by hand it starts its ranks itself (``torch.multiprocessing``: gloo on CPU, NCCL with
``--device cuda``, one GPU per rank).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import statistics
import tempfile
import time

import torch

from deltafin.bench.synthetic import K3_LATENT, write_synthetic

GB = 1e9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _split(labels: list[str], world: int) -> str:
    """The ranks spec giving rank r the r-th contiguous share of the drives (report4 over 2: internal + tb1)."""
    per = [labels[i * len(labels) // world:(i + 1) * len(labels) // world] for i in range(world)]
    return ";".join(",".join(p) for p in per)


def run(args) -> dict:
    from deltafin.io.emulator import parse_spec

    worlds = sorted({int(w) for w in str(args.worlds).split(",") if w.strip()})
    work = tempfile.mkdtemp(prefix="deltafin-bench-dist-", dir=args.dir)
    try:
        models = parse_spec(args.spec, args.scale)
        drives = [(m.label, os.path.join(work, m.label), m.gbps) for m in models]
        labels = [m.label for m in models]
        out = {"bench": "distributed", "device": args.device, "spec": ";".join(m.spec() for m in models),
               "layers": args.layers, "experts": args.experts, "k": args.k, "tokens": args.tokens, "runs": []}
        for world in worlds:
            if world > len(labels):
                raise ValueError(f"{world} ranks need at least {world} drives in --spec; it has {len(labels)}")
            root = os.path.join(work, f"model-{world}")
            write_synthetic(root, drives, args.layers, args.experts, seed=args.seed,
                            ranks=_split(labels, world) if world > 1 else None)
            out["runs"].append(_launch(world, root, args, work))
            shutil.rmtree(root, ignore_errors=True)
            for _, path, _ in drives:
                shutil.rmtree(os.path.join(path, "synthetic-k3"), ignore_errors=True)
        _summary(out)
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _launch(world: int, root: str, args, work: str) -> dict:
    import torch.multiprocessing as mp

    opts = {k: getattr(args, k) for k in ("device", "spec", "scale", "k", "tokens", "warmup", "threads", "seed",
                                          "io_only", "resident", "timeout")}
    res = os.path.join(work, f"result-{world}.json")
    if world == 1 and opts["device"] != "cuda":
        _rank_main(0, 1, 0, root, opts, res)
    else:  # on CUDA the one-rank run gets its own process too: this one keeps no GPU memory between runs
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world, port, root, opts, res)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(args.timeout * 4 + 600)
        for p in procs:
            if p.is_alive():
                p.kill()
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"bench distributed: ranks {bad} (rank, exit code) failed; see their output above")
    with open(res) as f:
        return json.load(f)


def _rank_main(rank: int, world: int, port: int, root: str, opts: dict, res: str) -> None:
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1 if opts["device"] == "cpu" and world > 1 else torch.get_num_threads())
    from deltafin.runtime import cluster

    try:
        rec = _measure(rank, world, root, opts)
        if rank == 0:
            tmp = res + ".tmp"
            with open(tmp, "w") as f:
                json.dump(rec, f)
            os.replace(tmp, res)
    finally:
        cluster.shutdown()


def _source(rank: int, world: int, root: str, opts: dict):
    """(expert source, the cluster or None, owners, this run's drive rates, device)."""
    from deltafin.io.direct import FileDriveReader
    from deltafin.io.emulator import EmulatedDriveSet, parse_spec
    from deltafin.runtime import cluster
    from deltafin.runtime.distributed import DistributedExperts, owners_from_manifest
    from deltafin.runtime.engine import own_drives
    from deltafin.runtime.source import StreamingExperts
    from deltafin.store.model_dir import PackedModel

    device = torch.device(opts["device"])
    cl = cluster.init(device, opts["timeout"]) if world > 1 else None
    device = cl.device if cl is not None else device
    pm = PackedModel.open(root, only=own_drives(root, rank) if cl is not None else None)
    cache = int(1e12) if opts["resident"] else 0
    if opts["resident"]:
        readers = [FileDriveReader(d.label, d.path) for d in pm.drives]
    else:  # emulated drives serve this rank's expert files from memory: the shared real disk stays out of it
        owners = owners_from_manifest(pm.doc, world)
        memory = {}
        for L in pm.moe_layers:
            for e in range(pm.num_experts):
                if owners[L][e] == rank:
                    memory[pm.expert_path(L, e)] = bytes(pm.read_expert_bytes(L, e)[0])
        spec = ";".join(f"{d.label}:{d.gbps}GBps" for d in pm.drives)
        readers = EmulatedDriveSet(parse_spec(spec), memory=memory, seed=rank).readers()
    src = StreamingExperts(pm, cache, opts["threads"], device, readers)
    owners = owners_from_manifest(pm.doc, world)
    if cl is not None:
        src = DistributedExperts(src, cl, owners)
    return src, cl, owners, pm, device


def _measure(rank: int, world: int, root: str, opts: dict) -> dict:
    from deltafin.bench.decode import situ_glu_expert
    from deltafin.models.base import moe_dispatch

    src, cl, owners, pm, device = _source(rank, world, root, opts)
    layers, E, k = pm.moe_layers, pm.num_experts, opts["k"]
    rng = random.Random(opts["seed"])  # the same routing on every rank
    steps = [{L: rng.sample(range(E), k) for L in layers} for _ in range(opts["warmup"] + opts["tokens"])]
    gen = torch.Generator().manual_seed(opts["seed"])
    x = torch.randn(1, K3_LATENT, generator=gen).to(device)
    w = torch.full((1, k), 1.0 / k, device=device)

    def expert(xs, t):
        return xs.new_zeros(xs.shape[0], K3_LATENT) if opts["io_only"] else situ_glu_expert(xs, t)

    if opts["resident"]:  # one pass over every owned expert: the steady state of a cache that holds them all
        for L in layers:
            for _ in src.fetch(L, [e for e in range(E) if owners[L][e] == rank]):
                pass
    for step in steps[: opts["warmup"]]:
        for L, ids in step.items():
            moe_dispatch(x, torch.tensor([ids], device=device), w, L, src, expert)
    _sync(device, cl)
    s0, c0 = _counters(src)
    t0 = time.perf_counter()
    for step in steps[opts["warmup"]:]:
        for L, ids in step.items():
            moe_dispatch(x, torch.tensor([ids], device=device), w, L, src, expert)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    s1, c1 = _counters(src)
    mine = {"rank": rank, "bytes_read": s1[0] - s0[0], "io_wait_s": s1[1] - s0[1], "collective_s": c1[0] - c0[0],
            "collectives": c1[1] - c0[1], "wall_s": wall}
    bare = _bare_allreduce(cl, k, device) if cl is not None else None
    from deltafin.runtime.distributed import gather

    ranks = gather(cl, mine) if cl is not None else [mine]
    src.close()
    return _record(world, pm, owners, steps[opts["warmup"]:], ranks, wall, bare, opts)


def _sync(device, cl) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    if cl is not None:
        import torch.distributed as dist

        dist.barrier(group=cl.ctl)


def _counters(src) -> tuple[tuple, tuple]:
    s, c = src.stats, getattr(src, "comm", None)
    return (s.bytes_read, s.io_wait_s), ((c.collective_s, c.collectives) if c else (0.0, 0))


def _bare_allreduce(cl, k: int, device, reps: int = 50) -> float:
    """Median seconds of one all-reduce of the decode slot buffer ([1, k, latent] float32 + the ids), alone."""
    import torch.distributed as dist

    buf = torch.zeros(k * K3_LATENT + k, device=device)
    times = []
    for _ in range(reps):
        dist.barrier(group=cl.ctl)
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _record(world, pm, owners, steps, ranks, wall, bare, opts) -> dict:
    """The run's figures with the read bound of the slower rank (per layer, summed)."""
    labels = [d.label for d in pm.drives]
    rk = pm.doc["experts"].get("ranks")
    groups = [r["drives"] for r in rk["ranks"]] if rk else [labels]
    rate = {d.label: d.gbps * GB for d in pm.drives}
    nbytes = pm.file_bytes(pm.moe_layers[0])
    bound_s = 0.0
    for step in steps:
        for L, ids in step.items():
            per = [sum(owners[L][e] == r for e in ids) * nbytes / sum(rate[x] for x in g)
                   for r, g in enumerate(groups)]
            bound_s += max(per)
    tokens = len(steps)
    n_coll = max(r["collectives"] for r in ranks)
    rec = {"world": world, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "ranks": ranks,
           "mode": "resident" if opts["resident"] else ("io-only" if opts["io_only"] else "full"),
           "read_bound_tok_s": tokens / bound_s if bound_s and not opts["resident"] else None,
           "collective_ms_per_layer": (1e3 * max(r["collective_s"] for r in ranks) / n_coll) if n_coll else 0.0,
           "bare_allreduce_ms": bare * 1e3 if bare is not None else None,
           "collective_ms_per_token": 1e3 * max(r["collective_s"] for r in ranks) / tokens,
           "rank_drives": groups, "rank_gbps": [sum(rate[x] for x in g) / GB for g in groups]}
    if rec["read_bound_tok_s"]:
        rec["of_read_bound"] = rec["tok_s"] / rec["read_bound_tok_s"]
    return rec


def _summary(out: dict) -> None:
    runs = {r["world"]: r for r in out["runs"]}
    for r in out["runs"]:
        line = (f"bench distributed: {r['world']} rank(s), {r['mode']}, {out['device']}: {r['tok_s']:.3f} tok/s")
        if r.get("read_bound_tok_s"):
            line += (f" = {r['of_read_bound']:.2f} of the slower rank's read bound {r['read_bound_tok_s']:.3f} tok/s "
                     f"(ranks' drives {', '.join(f'{g:.2f}' for g in r['rank_gbps'])} GB/s)")
        if r["world"] > 1:
            line += (f"; all-reduce {r['collective_ms_per_layer']:.2f} ms per layer in the step (waits for the slower "
                     f"rank) vs {r['bare_allreduce_ms']:.3f} ms alone; {r['collective_ms_per_token']:.1f} ms per token")
        if r["world"] > 1 and 1 in runs and r["mode"] == "resident":
            line += f"; {r['tok_s'] / runs[1]['tok_s']:.2f}x one rank (ideal {r['world']}x)"
        elif r["world"] > 1 and 1 in runs and runs[1].get("read_bound_tok_s"):
            line += (f"; {r['tok_s'] / runs[1]['tok_s']:.2f}x one rank on all the drives (same drives: the split's "
                     f"read bound is {r['read_bound_tok_s'] / runs[1]['read_bound_tok_s']:.2f}x one rank's)")
        print(line)
