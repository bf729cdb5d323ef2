"""``deltafin bench ingest``: the expert ingestion path stage by stage, each stage beside its own limit.

Measured in one run over one synthetic model of Kimi K3-size expert files (``bench.synthetic``), in GB/s of
expert bytes:

* limits: a memory copy on every core, xxh3-64 on one core and on every core, page-locked host -> device
  (CUDA), xxh3-64 on the GPU beside the device's own copy rate (CUDA), the layer's expert math with the weights already in memory, and, at each reads-in-flight setting,
  the raw rate of whole-file reads of the same files;
* the engine end to end (``StreamingExperts.fetch``, as decode uses it, cold): reads alone, checked and not,
  and full decode (reads + the layer's expert math on the device), with the time the reader threads spent
  checking; on CUDA full decode with reads checked on the GPU (the default there) and on the host;
* ``--offered``: the same files served by an emulated drive at each offered rate (``deltafin.io.emulator``):
  delivered / offered on the CPU and on CUDA, the curve (``--plot``);
* ``--drives SPEC`` (``report4``: the public Kimi K3 write-up's four drives, 25 GB/s summed): decode at Kimi
  K3's shape (``--k3-shape``: 92 MoE layers x 16 experts a token) through those emulated drives, tok/s beside
  the bound of the set for the same routes.

Targets (``deltafin bench ingest --help``): reads alone >= 0.9 of the raw rate at every setting; full decode
>= 0.9 of min(raw, host -> device) on CUDA and >= 0.8 of raw on the CPU, the step within 1.15x of
max(I/O, math).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from deltafin.bench.decode import routes
from deltafin.bench.ingest_cli import K3_MOE_LAYERS, K3_TOPK
from deltafin.bench.synthetic import K3_ACT, K3_LATENT, write_synthetic
from deltafin.io.mapped import memory_fs


@dataclass
class Pass:
    """One cold decode pass through the engine's source."""

    seconds: float
    bytes: int
    check_s: float
    math_s: float
    io_wait_s: float
    first_ms: float = 0.0  # median, over layers, from the layer's fetch to its first expert landing
    layer_ms: float = 0.0  # median time of a layer's fetch
    checks: str = "host"  # where reads were checked: host, gpu, off
    gpu_check_s: float = 0.0  # GPU time of the checks' launches
    gpu_check_wait_s: float = 0.0  # host time from their launch to the digests (the layer's copies included)
    guessed: int = 0  # experts read ahead on a guess (``guess``), of them asked for
    guess_used: int = 0
    compute_threads: int = 0  # the CPU's expert math: the faster of all threads and half (0: not on the CPU)
    mapped: bool = False  # the files' pages were mapped, not copied (``io.mapped``: a drive in memory)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9


# ---------------------------------------------------------------------------------------------- limits


def _threads(n: int, fn) -> float:
    """Run fn(i) on n threads at once; the wall seconds."""
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def memcpy_gbps(threads: int, nbytes: int = 64 << 20, rounds: int = 4) -> float:
    """Bytes copied per second by ``threads`` threads at once (numpy copies release the GIL), each between its
    own buffers larger than the caches: what a read served from memory (page cache, tmpfs) can reach."""
    src = [np.full(nbytes, i + 1, dtype=np.uint8) for i in range(threads)]
    dst = [np.empty(nbytes, dtype=np.uint8) for _ in range(threads)]
    for d, s in zip(dst, src, strict=True):
        np.copyto(d, s)  # pages mapped outside the timing

    def work(i: int) -> None:
        for _ in range(rounds):
            np.copyto(dst[i], src[i])

    return threads * rounds * nbytes / _threads(threads, work) / 1e9


def xxh3_gbps_threads(threads: int, nbytes: int, total_per_thread: int = 256 << 20) -> float:
    """xxh3-64 over ``nbytes`` buffers on ``threads`` threads at once (xxhash releases the GIL)."""
    import xxhash

    per = max(2, -(-total_per_thread // nbytes))
    bufs = [[np.full(nbytes, (i + j) % 251, dtype=np.uint8) for j in range(per)] for i in range(threads)]

    def work(i: int) -> None:
        for b in bufs[i]:
            xxhash.xxh3_64_intdigest(b)

    work(0)
    return threads * per * nbytes / _threads(threads, work) / 1e9


def xxh3_gpu_gbps(nbytes: int, rows: int = 16) -> tuple[float, float]:
    """(xxh3-64 on the GPU, the device's own copy) in GB/s of bytes hashed / copied: ``rows`` expert files in
    device memory hashed in one pair of launches (as a layer's are), and the same bytes copied device to device (each byte
    read and written), both timed with events, the best of three."""
    from deltafin import kernels

    data = torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(data)
    slots, lengths = list(range(rows)), [nbytes] * rows
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def best(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t = float("inf")
        for _ in range(3):
            a.record()
            fn()
            b.synchronize()
            t = min(t, a.elapsed_time(b) / 1e3)
        return t

    if kernels.xxh3_64_rows(data, slots, lengths) is None:
        return 0.0, 0.0
    hashed = best(lambda: kernels.xxh3_64_rows(data, slots, lengths, b.record))
    copied = best(lambda: (dst.copy_(data), b.record()))
    return data.numel() / hashed / 1e9, data.numel() / copied / 1e9


def h2d_gbps(nbytes: int, copies: int = 16) -> float:
    """Page-locked host -> device copies of ``nbytes`` (an expert file), back to back, timed with events."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(7)
    dst = torch.empty(copies, nbytes, dtype=torch.uint8, device="cuda")
    for i in range(copies):
        dst[i].copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        a.record()
        for i in range(copies):
            dst[i].copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return copies * nbytes / best / 1e9


def map_ms(paths: list[str], device: str) -> float:
    """Milliseconds to map a file in memory (``io.mapped``), page-locked for CUDA on ``device`` cuda: what a file's
    first read costs where it was not mapped at open (``StreamingExperts.premap``)."""
    from deltafin.io.mapped import FileMaps

    maps = FileMaps("probe")
    maps.cuda = device == "cuda"
    t0 = time.perf_counter()
    try:
        for p in paths:
            maps.view(p, 1)
        return (time.perf_counter() - t0) * 1e3 / max(len(paths), 1)
    finally:
        maps.close()


def layer_math_s(pm, step: dict[int, list[int]], device: str) -> float:
    """The expert math of one token's layers with every expert already in memory (the math's limit): on CUDA
    the grouped kernels over a slab, as decode runs them; on the CPU the layer's experts in one call (``glu_many``),
    as the engine runs a cached group."""
    L0, ids = next(iter(step.items()))
    experts = [pm.read_expert(L0, e, verify=False) for e in ids]
    if device == "cuda":
        from deltafin.kernels import cuda as kc
        from deltafin.kernels.triton_moe import ExpertSlab

        slab = ExpertSlab.stack([{k: v.to("cuda") for k, v in t.items()} for t in experts], "cuda")
        got = [(e, slab.views(i)) for i, e in enumerate(ids)]
        x = torch.randn(1, K3_LATENT, device="cuda", dtype=torch.bfloat16)
        ids_host = torch.tensor([ids], dtype=torch.int64)
        w = torch.full((1, len(ids)), 1.0 / len(ids), device="cuda")
        for _ in range(3):
            kc.grouped_moe(x, ids_host, w, got, K3_ACT, slab)
        torch.cuda.synchronize()
        n = 50
        t0 = time.perf_counter()
        for _ in range(n):
            kc.grouped_moe(x, ids_host, w, got, K3_ACT, slab)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * len(step)
    from deltafin.bench.decode import situ_glu_expert
    from deltafin.models.base import group_outputs

    x = torch.randn(1, K3_LATENT)
    group = list(enumerate(experts))

    def layer() -> None:  # in one call where the kernels take them, as the engine's cached experts run
        group_outputs(x, [None] * len(group), group, K3_ACT, situ_glu_expert)

    layer()
    t0 = time.perf_counter()
    layer()
    return (time.perf_counter() - t0) * len(step)


# ---------------------------------------------------------------------------------------------- the engine


def decode_pass(pm, rts: list[dict[int, list[int]]], threads: int, device: str, verify: bool, math: bool,
                readers=None, verify_on: str = "auto", guess: float | None = None, map_files: bool | None = None
                ) -> Pass:
    """``_decode_pass``; with the expert math on the CPU, at all compute threads and at half of them, the faster
    kept, as the engine's decode steps pick their thread count by measurement (``runtime.threads``): where the
    same cores also copy and check the reads, fewer compute threads can be faster (the H200 host's 16 cores,
    files in memory: full decode 10.8-13.0 GB/s on 16 threads, 16.9-17.6 on 8)."""
    if device != "cpu" or not math:
        return _decode_pass(pm, rts, threads, device, verify, math, readers, verify_on, guess, map_files)
    most, best = torch.get_num_threads(), None
    for n in sorted({most, max(1, most // 2)}, reverse=True):
        torch.set_num_threads(n)
        try:
            p = _decode_pass(pm, rts, threads, device, verify, math, readers, verify_on, guess, map_files)
        finally:
            torch.set_num_threads(most)
        p.compute_threads = n
        best = p if best is None or p.seconds < best.seconds else best
    return best


def _decode_pass(pm, rts: list[dict[int, list[int]]], threads: int, device: str, verify: bool, math: bool,
                 readers=None, verify_on: str = "auto", guess: float | None = None, map_files: bool | None = None
                 ) -> Pass:
    """Decode ``rts`` cold through a fresh source (read buffers mapped at open, outside the timing); reads checked
    where ``verify_on`` says (``StreamingExperts``: auto is the GPU on CUDA). ``guess``: each next layer of a token
    is guessed (``StreamingExperts.guess``) before a layer runs, that share of its experts right
    (``guessed_routes``), as decode's ``--guess-next`` does with the router's guess. ``map_files``: False reads a
    drive in memory as any other (the source's default maps its files, ``io.mapped``)."""
    from deltafin.runtime.source import StreamingExperts

    src = StreamingExperts(pm, cache_bytes=0, threads=threads, device=device, verify=verify, readers=readers,
                           verify_on=verify_on, map_files=map_files)
    src.premap()  # files in memory: mapped (page-locked on CUDA) outside the timing, as read buffers are at open
    layer = _layer_fn(device, math)
    marks: list[tuple[float, float, float]] = []
    guesses = None if guess is None else guessed_routes(rts, guess, pm.num_experts)
    try:
        t0 = time.perf_counter()
        for t, step in enumerate(rts):
            order = list(step.items())
            for j, (L, ids) in enumerate(order):
                if guesses is not None and j + 1 < len(order):  # the next token's first layer cannot be guessed
                    src.guess(order[j + 1][0], guesses[t][order[j + 1][0]], read=True)
                layer(_Marked(src, marks), L, ids)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        st = src.stats
        check = sum(c.check_seconds for c in src.pool.counters)
        first = sorted((f - a) * 1e3 for a, f, _ in marks)
        whole = sorted((b - a) * 1e3 for a, _, b in marks)
        return Pass(wall, st.bytes_read, check, st.expert_math_s, st.io_wait_s, first[len(first) // 2],
                    whole[len(whole) // 2], src.checks_where, st.gpu_check_s, st.gpu_check_wait_s, st.guessed,
                    st.guess_used, mapped=bool(src.mapped) and all(r.maps.off is None for r in src.mapped))
    finally:
        src.close()


def guessed_routes(rts: list[dict[int, list[int]]], right: float, experts: int, seed: int = 0
                   ) -> list[dict[int, list[int]]]:
    """Guesses of ``rts``: of each layer's k experts, round(right * k) kept, the rest other experts at random."""
    rng = np.random.default_rng(seed)
    out = []
    for step in rts:
        g = {}
        for L, ids in step.items():
            keep = [int(e) for e in rng.permutation(ids)[: round(right * len(ids))]]
            others = [e for e in range(experts) if e not in ids]
            wrong = min(len(ids) - len(keep), len(others))  # a layer routed to all its experts has no wrong guess
            g[L] = keep + [int(e) for e in rng.choice(others, wrong, replace=False)]
        out.append(g)
    return out


class _Marked:
    """A source whose fetches note (start, first expert landed, last expert landed)."""

    def __init__(self, src, marks: list):
        self.src, self.marks, self.slab = src, marks, src.slab

    def fetch(self, L, ids):
        return self._marked(self.src.fetch(L, ids))

    def fetch_groups(self, L, ids):
        return self._marked(self.src.fetch_groups(L, ids, checks_later=True))

    def _marked(self, items):
        t0 = time.perf_counter()
        first = None
        for item in items:
            first = first or time.perf_counter()
            yield item
        self.slab = self.src.slab
        self.marks.append((t0, first or t0, time.perf_counter()))


def _layer_fn(device: str, math: bool):
    """One MoE layer of decode as the engine runs it: on CUDA every expert lands in the slab, then the grouped
    kernels run once (one synchronisation a layer, the routing's); on the CPU each group the source hands over
    runs in one call (an expert read from a drive as it lands; files mapped from memory all at once, checked while
    the math reads them)."""
    if not math:
        def io_only(src, L, ids):
            for _ in src.fetch(L, ids):
                pass
        return io_only
    if device == "cuda":
        from deltafin.kernels import cuda as kc

        x = torch.randn(1, K3_LATENT, device="cuda", dtype=torch.bfloat16)

        def cuda_layer(src, L, ids):
            got = list(src.fetch(L, ids))
            w = torch.full((1, len(ids)), 1.0 / len(ids), device="cuda")
            kc.grouped_moe(x, torch.tensor([ids], dtype=torch.int64), w, got, K3_ACT, src.slab)
        return cuda_layer
    from deltafin.bench.decode import situ_glu_expert
    from deltafin.models.base import group_outputs, settle

    xc = torch.randn(1, K3_LATENT)

    def cpu_layer(src, L, ids):
        for group in src.fetch_groups(L, ids):  # as the engine's one-token MoE step takes them (models.base)
            group_outputs(xc, [None] * len(group), group, K3_ACT, situ_glu_expert)
            for _, t in settle(group):
                situ_glu_expert(xc, t)
    return cpu_layer


def routes_bound_s(pm, rts: list[dict[int, list[int]]], rates: list[float]) -> float:
    """Seconds the drives need for ``rts`` at ``rates`` (GB/s), each layer waiting for its slowest drive: the
    read bound of those routes on that placement (each expert read from its first copy)."""
    total = 0.0
    for step in rts:
        for L, ids in step.items():
            per = [0] * len(rates)
            for e in ids:
                per[pm.locations(L, e)[0]] += pm.file_bytes(L)
            total += max(b / (r * 1e9) for b, r in zip(per, rates, strict=True))
    return total


# ---------------------------------------------------------------------------------------------- the run


def _numbers(text: str, what: str, kind, example: str) -> list:
    """A comma-separated list of numbers above 0 (``kind``: int or float), or one line naming it and the fix."""
    from deltafin.errors import UsageError

    try:
        vals = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or any(not (0 < v < 1e4) for v in vals):
        raise UsageError(f"bench ingest: {what} {text!r}: give a comma-separated list of numbers above 0, "
                         f"e.g. {what} {example}")
    return vals


def check_args(args) -> None:
    """Every argument checked before anything is written."""
    from deltafin.errors import UsageError

    if args.layers < 1 or args.experts < 1 or args.tokens < 1 or args.k < 1:
        raise UsageError("bench ingest: need --layers, --experts, --tokens and --k of at least 1")
    if args.k > args.experts:
        raise UsageError(f"bench ingest: --k {args.k} routes more experts than a layer has (--experts "
                         f"{args.experts}); lower --k or raise --experts")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("bench ingest: --device cuda but no CUDA device is visible; use --device cpu")
    if args.dir is not None and not os.path.isdir(args.dir):
        raise UsageError(f"bench ingest: --dir {args.dir}: no such folder; create it or pick another")
    guess = args.guess = getattr(args, "guess", None)
    if guess is not None and not 0 <= guess <= 1:
        raise UsageError(f"bench ingest: --guess {guess}: give the share of a layer's experts guessed right, from 0 "
                         f"to 1 (1: the routes known a layer ahead)")
    if args.k3_shape and not args.drives:
        raise UsageError("bench ingest: --k3-shape applies to the decode through --drives; add --drives report4")
    args.threads_list = _numbers(args.threads, "--threads", int, "8,32")
    args.offered_list = _numbers(args.offered, "--offered", float, "2,5,10,25,50") if args.offered else []
    if args.drives:
        from deltafin.io.emulator import parse_spec

        args.drive_models = parse_spec(args.drives)


def run(args) -> dict:
    check_args(args)
    from deltafin import kernels

    with kernels.math(False, args.device):
        return _run(args)


def _run(args) -> dict:
    from deltafin.bench.disk import raw_read_gbps
    from deltafin.store.model_dir import PackedModel

    work = tempfile.mkdtemp(prefix="deltafin-bench-ingest-", dir=args.dir)
    cores = os.cpu_count() or 1
    rec: dict = {"bench": "ingest", "device": args.device, "cores": cores, "layers": args.layers,
                 "experts": args.experts, "k": args.k, "tokens": args.tokens}
    try:
        root = write_synthetic(os.path.join(work, "model"), [("d0", os.path.join(work, "d0"), 1.0)],
                               args.layers, args.experts, seed=args.seed)
        pm = PackedModel.open(root)
        nbytes = pm.file_bytes(pm.moe_layers[0])
        rts = routes(pm.moe_layers, pm.num_experts, args.k, args.tokens, args.seed)
        paths = [pm.expert_path(L, e) for L in pm.moe_layers for e in range(pm.num_experts)]
        pm = _with_drive_rate(root, raw_read_gbps(paths, nbytes, max(args.threads_list)))
        rec["expert_file_bytes"] = nbytes
        rec["files_in_memory"] = memory_fs(work)
        lim = rec["limits"] = {
            "memcpy_GBps": memcpy_gbps(cores), "xxh3_1core_GBps": xxh3_gbps_threads(1, nbytes),
            f"xxh3_{cores}cores_GBps": xxh3_gbps_threads(cores, nbytes),
            "math_s_per_token": layer_math_s(pm, rts[0], args.device),
        }
        if rec["files_in_memory"]:
            lim["map_ms_per_file"] = map_ms(paths[: 4 * args.k], args.device)
        if args.device == "cuda":
            lim["h2d_pinned_GBps"] = h2d_gbps(nbytes)
            lim["xxh3_gpu_GBps"], lim["d2d_copy_GBps"] = xxh3_gpu_gbps(nbytes, args.k)
        _print_limits(rec)
        rec["settings"] = []
        for t in args.threads_list:
            raw = raw_read_gbps(paths, nbytes, t)
            row = {"in_flight": t, "raw_GBps": raw, "guess": args.guess}
            passes = [("io_verified", True, False, "auto", None), ("io_unverified", False, False, "auto", None),
                      ("full", True, True, "auto", None)]
            if args.device == "cuda":  # the default checks reads on the GPU there: the host's checks beside them
                passes.append(("full_host_checks", True, True, "host", None))
            if getattr(args, "guess", None) is not None:  # the next layer's reads started a layer early, on a guess this often right
                passes += [("io_guess", True, False, "auto", args.guess), ("full_guess", True, True, "auto", args.guess)]
            if rec["files_in_memory"]:  # the files mapped (the default there) and, beside them, copied by reads
                passes += [("io_copied", True, False, "auto", None, False), ("full_copied", True, True, "auto", None, False)]
            for name, verify, math, where, guess, *mapping in passes:
                p = decode_pass(pm, rts, t, args.device, verify, math, verify_on=where, guess=guess,
                                map_files=mapping[0] if mapping else None)
                row[name] = _pass_doc(p)
            row["raw_GBps_after"] = raw_read_gbps(paths, nbytes, t)
            row["raw_GBps"] = max(raw, row["raw_GBps_after"])  # the stricter of the two probes
            _rate_ratios(row, rec, args.device)
            rec["settings"].append(row)
            _print_row(row, args.device)
        if args.offered_list:
            best = max(rec["settings"], key=lambda r: r["full"]["GBps"])["in_flight"]  # the curve at the best setting
            rec["curve_in_flight"] = best
            rec["curve"] = offered_curve(pm, rts, args.offered_list, best, args.device, args.guess)
            if args.plot:
                plot_curve(rec["curve"], args.plot, args.guess)
        if args.drives:
            rec["drive_set"] = drive_set_decode(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        from deltafin.store.manifest import write_json_atomic

        write_json_atomic(args.json, rec)
    return rec


def _with_drive_rate(root: str, gbps: float):
    """The model reopened with its drive's rate as measured (what ``pack`` records from its drive probe)."""
    from deltafin.store import manifest as mf
    from deltafin.store.model_dir import PackedModel

    path = os.path.join(root, mf.MANIFEST)
    with open(path) as f:
        doc = json.load(f)
    doc["drives"][0]["gbps"], doc["drives"][0]["measured"] = round(gbps, 3), True
    mf.write_json_atomic(path, doc)
    return PackedModel.open(root)


def _pass_doc(p: Pass) -> dict:
    return {"GBps": p.gbps, "seconds": p.seconds, "bytes": p.bytes, "check_s": p.check_s,
            "check_cores": p.check_s / p.seconds, "io_wait_s": p.io_wait_s, "first_ms": p.first_ms,
            "layer_ms": p.layer_ms, "checks": p.checks, "gpu_check_s": p.gpu_check_s,
            "gpu_check_wait_s": p.gpu_check_wait_s, "guessed": p.guessed, "guess_used": p.guess_used,
            "compute_threads": p.compute_threads, "mapped": p.mapped}


def _rate_ratios(row: dict, rec: dict, device: str) -> None:
    raw = row["raw_GBps"]
    row["layer_ms_at_raw"] = rec["k"] * rec["expert_file_bytes"] / (raw * 1e9) * 1e3
    row["io_over_raw"] = row["io_verified"]["GBps"] / raw
    row["io_unverified_over_raw"] = row["io_unverified"]["GBps"] / raw
    limit = min(raw, rec["limits"]["h2d_pinned_GBps"]) if device == "cuda" else raw
    # files in memory (tmpfs, page cache): every byte decoded is copied by the kernel (read + write), hashed (read)
    # and then copied to the device (CUDA) or read by the expert math (CPU): the host's memory traffic bounds the
    # path too, at a quarter of the copy's traffic; with the checks on the GPU the hash's read is gone: a third
    # mapped (``io.mapped``), the kernel's copy is gone: the DMA alone (checks on the GPU), or the hash and the DMA or
    # the CPU's math
    row["memory_bound_GBps"] = 2 * rec["limits"]["memcpy_GBps"] / _touches(row["full"])
    row["memory_bound_host_checks_GBps"] = 2 * rec["limits"]["memcpy_GBps"] / (2 if row["full"].get("mapped") else 4)
    if "full_copied" in row:
        row["memory_bound_copied_GBps"] = 2 * rec["limits"]["memcpy_GBps"] / _touches(row["full_copied"])
        row["full_copied_over_limit"] = row["full_copied"]["GBps"] / limit
        row["io_copied_over_raw"] = row["io_copied"]["GBps"] / raw
    if "full_host_checks" in row:
        row["full_host_checks_over_limit"] = row["full_host_checks"]["GBps"] / limit
    row["full_limit_GBps"] = limit
    row["full_over_limit"] = row["full"]["GBps"] / limit
    io_s = row["full"]["bytes"] / (raw * 1e9)
    math_s = rec["limits"]["math_s_per_token"] * rec["tokens"]
    row["step_over_bound"] = row["full"]["seconds"] / max(io_s, math_s)
    if "full_guess" in row:
        row["io_guess_over_raw"] = row["io_guess"]["GBps"] / raw
        row["full_guess_over_limit"] = row["full_guess"]["GBps"] / limit
        row["step_guess_over_bound"] = row["full_guess"]["seconds"] / max(io_s, math_s)


def _touches(p: dict) -> int:
    """Times host memory is touched per byte decoded from files in memory, by the pass ``p``."""
    gpu = p.get("checks") == "gpu"
    if p.get("mapped"):
        return 1 if gpu else 2
    return 3 if gpu else 4


def offered_curve(pm, rts, offered: list[float], threads: int, device: str, guess: float | None = None
                  ) -> list[dict]:
    """Delivered GB/s against an emulated drive offering each rate (same files, same routes); with ``guess`` also
    with each next layer guessed that often right (series ``<device>_guess``)."""
    from deltafin.io.emulator import emulated_readers

    out = []
    devices = ["cpu", "cuda"] if device == "cuda" else ["cpu"]
    series = [(d, None) for d in devices] + ([(d, guess) for d in devices] if guess is not None else [])
    layer_math_s(pm, rts[0], "cpu")  # untimed: a CUDA run's first CPU pass would otherwise build the CPU kernels
    for gbps in offered:
        row = {"offered_GBps": gbps}
        for dev, g in series:
            readers = emulated_readers(f"d0:{gbps}GBps,lat=80us", pm)
            p = decode_pass(pm, rts, threads, dev, True, True, readers=readers, guess=g)
            name = dev if g is None else f"{dev}_guess"
            row[f"{name}_GBps"] = p.gbps
            row[f"{name}_over_offered"] = p.gbps / gbps
        out.append(row)
        print(f"curve: offered {gbps:.1f} GB/s -> "
              + ", ".join(f"{d} {row[f'{d}_GBps']:.2f} GB/s ({row[f'{d}_over_offered']:.2f})"
                          for d in (k[:-5] for k in row if k.endswith("_GBps") and k != "offered_GBps")),
              flush=True)
    return out


def drive_set_decode(args, work: str) -> dict:
    """Decode through an emulated drive set (files on the scratch folder, one folder a drive, placed by the
    drives' rates), at Kimi K3's shape with --k3-shape: tok/s beside the set's bound for the same routes."""
    from deltafin.io.emulator import emulated_readers
    from deltafin.store.model_dir import PackedModel

    models = args.drive_models
    layers, experts = (K3_MOE_LAYERS, 20) if args.k3_shape else (args.layers, args.experts)
    k = K3_TOPK if args.k3_shape else args.k
    tokens = 2 if args.k3_shape else args.tokens
    drives = [(m.label, os.path.join(work, f"set-{m.label}"), m.gbps) for m in models]
    root = write_synthetic(os.path.join(work, "set-model"), drives, layers, experts, seed=args.seed + 1)
    pm = PackedModel.open(root)
    rts = routes(pm.moe_layers, pm.num_experts, k, tokens, args.seed + 1)
    rates = [m.gbps for m in models]
    bound = routes_bound_s(pm, rts, rates)
    summed = sum(rates)
    per_token = k * len(pm.moe_layers) * pm.file_bytes(pm.moe_layers[0])
    out = {"spec": args.drives, "summed_GBps": summed, "moe_layers": layers, "k": k, "tokens": tokens,
           "bytes_per_token": per_token, "ideal_tok_s": summed * 1e9 / per_token,
           "routes_bound_tok_s": tokens / bound}
    devices = ["cpu", "cuda"] if args.device == "cuda" else ["cpu"]
    threads = max(1, max(args.threads_list) // len(models))  # the reads in flight shared by the drives
    runs = [(dev, None) for dev in devices] + ([(dev, args.guess) for dev in devices] if args.guess is not None else [])
    for dev, guess in runs:
        readers = emulated_readers(args.drives, pm)
        p = decode_pass(pm, rts, threads, dev, True, True, readers=readers, guess=guess)
        name = dev if guess is None else f"{dev}_guess"
        out[name] = {"tok_s": tokens / p.seconds, "GBps": p.gbps, "over_bound": (tokens / p.seconds) /
                     (tokens / bound), "check_cores": p.check_s / p.seconds, "guess": guess}
        how = "" if guess is None else f", next layer guessed ({guess:.0%} right)"
        print(f"drives {args.drives} ({summed:.1f} GB/s summed), {layers} MoE layers x {k} experts a token "
              f"({per_token / 1e9:.1f} GB), {dev}{how}: {tokens / p.seconds:.3f} tok/s ({p.gbps:.2f} GB/s) vs the "
              f"set's bound for these routes {tokens / bound:.3f} tok/s = {out[name]['over_bound']:.2f} "
              f"(ideal split {out['ideal_tok_s']:.3f} tok/s; target >= 0.90)", flush=True)
    shutil.rmtree(os.path.join(work, "set-model"), ignore_errors=True)
    for _, path, _ in drives:
        shutil.rmtree(path, ignore_errors=True)
    return out


def plot_curve(curve: list[dict], path: str, guess: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["offered_GBps"] for r in curve]
    ax.plot(xs, xs, "k--", lw=1, label="offered")
    for dev in ("cpu", "cuda", "cpu_guess", "cuda_guess"):
        if f"{dev}_GBps" in curve[0]:
            label = dev.replace("_guess", f", next layer guessed ({guess:.0%} right)" if guess is not None else "")
            ax.plot(xs, [r[f"{dev}_GBps"] for r in curve], "o-" if "guess" not in dev else "s--",
                    label=f"delivered, full decode, {label}")
    ax.set_xlabel("rate offered by the drives (GB/s)")
    ax.set_ylabel("expert bytes delivered (GB/s)")
    ax.set_title("Deltafin expert ingestion: delivered against offered")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = f"{path}.tmp-{os.getpid()}.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)


def _print_limits(rec: dict) -> None:
    lim, c = rec["limits"], rec["cores"]
    line = (f"ingest limits ({rec['device']}, {c} cores, {rec['expert_file_bytes'] / 1e6:.2f} MB expert files): "
            f"memory copy {lim['memcpy_GBps']:.1f} GB/s on {c} threads; xxh3 {lim['xxh3_1core_GBps']:.2f} GB/s on "
            f"one core, {lim[f'xxh3_{c}cores_GBps']:.1f} on {c}; expert math "
            f"{lim['math_s_per_token'] * 1e3:.2f} ms a token ({rec['layers']} layers x {rec['k']})")
    if "h2d_pinned_GBps" in lim:
        line += f"; page-locked host->device {lim['h2d_pinned_GBps']:.1f} GB/s"
    if "map_ms_per_file" in lim:
        line += (f"; files in memory ({rec['files_in_memory']}): mapping one"
                 f"{' and page-locking it' if rec['device'] == 'cuda' else ''} {lim['map_ms_per_file']:.2f} ms")
    if lim.get("xxh3_gpu_GBps"):
        line += (f"; xxh3 on the GPU {lim['xxh3_gpu_GBps']:.0f} GB/s beside the device's own copy "
                 f"{lim['d2d_copy_GBps']:.0f} GB/s ({lim['xxh3_gpu_GBps'] / lim['d2d_copy_GBps']:.2f})")
    print(line, flush=True)


def _print_row(row: dict, device: str) -> None:
    f = row["full"]
    print(f"{row['in_flight']} in flight: raw {row['raw_GBps']:.2f} GB/s; reads alone {row['io_verified']['GBps']:.2f} "
          f"GB/s = {row['io_over_raw']:.2f} of raw (target >= 0.90; {_where_checked(row['io_verified'])}), unchecked {row['io_unverified']['GBps']:.2f} = "
          f"{row['io_unverified_over_raw']:.2f} (a layer {row['io_unverified']['layer_ms']:.1f} ms, first expert "
          f"{row['io_unverified']['first_ms']:.1f} ms, at raw {row['layer_ms_at_raw']:.1f}); full decode on {device} {f['GBps']:.2f} GB/s = "
          f"{row['full_over_limit']:.2f} of {row['full_limit_GBps']:.2f} (target >= "
          f"{0.9 if device == 'cuda' else 0.8:.2f}), step {row['step_over_bound']:.2f}x max(I/O, math) "
          f"(target <= 1.15); from memory the host's memory traffic allows {row['memory_bound_GBps']:.1f}"
          + (f"; the CPU's math on {f['compute_threads']} threads (the faster of all and half)"
             if f.get("compute_threads") else "")
          + _checks_note(row), flush=True)
    if "full_copied" in row:
        c = row["full_copied"]
        print(f"  files {'mapped' if f.get('mapped') else 'NOT mapped'} above; copied by reads (DELTAFIN_MAP_FILES=0): "
              f"reads alone {row['io_copied']['GBps']:.2f} GB/s = {row['io_copied_over_raw']:.2f} of raw; full decode "
              f"{c['GBps']:.2f} GB/s = {row['full_copied_over_limit']:.2f} of {row['full_limit_GBps']:.2f} (memory "
              f"traffic allows {row['memory_bound_copied_GBps']:.1f}); mapped / copied "
              f"{f['GBps'] / c['GBps']:.2f}x", flush=True)
    if "full_guess" in row:
        g = row["full_guess"]
        print(f"  next layer guessed ({row['guess']:.0%} right): reads alone {row['io_guess']['GBps']:.2f} GB/s = "
              f"{row['io_guess_over_raw']:.2f} of raw (a layer {row['io_guess']['layer_ms']:.1f} ms); full decode "
              f"{g['GBps']:.2f} GB/s = {row['full_guess_over_limit']:.2f} of {row['full_limit_GBps']:.2f}, step "
              f"{row['step_guess_over_bound']:.2f}x max(I/O, math)", flush=True)


def _where_checked(p: dict) -> str:
    if p.get("checks") == "gpu":
        return f"checked on the GPU, {p['gpu_check_s'] * 1e3:.1f} ms of its time"
    return f"checksums on {p['check_cores']:.1f} cores"


def _checks_note(row: dict) -> str:
    """Where full decode's reads were checked, and on CUDA the host's checks beside the GPU's."""
    f = row["full"]
    if f.get("checks") != "gpu":
        return f"; reads checked on the {f.get('checks', 'host')}"
    note = (f"; reads checked on the GPU ({f['gpu_check_s'] * 1e3:.1f} ms of GPU time, the host waited "
            f"{f['gpu_check_wait_s'] * 1e3:.1f} ms for them and the layers' copies)")
    h = row.get("full_host_checks")
    if h is not None:
        note += (f"; with host checks {h['GBps']:.2f} GB/s = {row['full_host_checks_over_limit']:.2f} (checksums on "
                 f"{h['check_cores']:.1f} cores; memory traffic allows {row['memory_bound_host_checks_GBps']:.1f})")
    return note
