"""``deltafin bench kernels --device mlx`` and ``deltafin bench decode --device mlx``.

kernels: MLX's matmuls on Kimi K3's shapes (the MXFP4 expert at 1, 4 and 32 tokens; the int8 trunk's matrices at
one token), GB/s of weight bytes beside the device's copy rate measured in the same run (an MLX copy of 1 GiB, bytes
read and written), and the one-token K3 expert step: a layer's 16 routed MXFP4 experts in one ``gather_qmm`` pass
over slot indices of an expert slab, SiTU-GLU between, as the engine runs it.

decode: Kimi K3-size expert files streamed through the MLX engine's source (reads landing in the slab) and
multiplied there, one token's 16 experts a layer, beside the drive's raw direct read rate measured in the same run,
as ``deltafin bench decode`` on the CPU.

On Linux MLX runs on its CPU build (reference BLAS, about one thread): figures there check that the path works and
give no speed target; on a Mac the ratios are what to read.
"""

from __future__ import annotations

import random
import time

import numpy as np

from deltafin.bench.synthetic import K3_ACT, K3_INTER, K3_LATENT
from deltafin.kernels import mlx as km

INT8_SHAPES = [(12288, 7168), (7168, 12288), (3584, 7168)]
TOKENS = (1, 4, 32)
COPY_GIB = 1.0


def copy_rate(gib: float = 1.0, reps: int = 3) -> float:
    """Best GB/s (bytes read plus written) of an MLX copy of ``gib`` GiB on the default device."""
    m = km.mx()
    a = m.ones((int(gib * (1 << 30)) // 4,), dtype=m.float32)
    m.eval(a)
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        b = a + 0  # one read and one write of every byte
        m.eval(b)
        best = max(best, 2 * a.nbytes / (time.perf_counter() - t) / 1e9)
        del b
    return best


def _timed(fn, seconds: float) -> float:
    """Best seconds of one call of ``fn`` (evaluated), over ``seconds`` of calls."""
    m = km.mx()
    m.eval(fn())  # warm: kernels compiled, memory mapped
    best, end = float("inf"), time.perf_counter() + seconds
    while True:
        t = time.perf_counter()
        m.eval(fn())
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() > end:
            return best


def _mxfp4(rng, out: int, inn: int) -> km.MXWeight:
    m = km.mx()
    w = rng.integers(0, 2**32, (out, inn // 8), dtype=np.uint64).astype(np.uint32)
    return km.MXWeight((out, inn), m.array(w), m.array(rng.integers(118, 124, (out, inn // 32), dtype=np.uint8)),
                       None, 32, 4, "mxfp4")


def _int8(rng, out: int, inn: int, dtype) -> km.MXWeight:
    import torch

    from deltafin.quant.record import QTensor

    q = torch.from_numpy(rng.integers(-127, 128, (out, inn), dtype=np.int8))
    s = torch.from_numpy(rng.uniform(1e-3, 1e-2, out).astype(np.float32))
    return km.prepare(QTensor("int8", (out, inn), q, s), dtype)


def _nbytes(w: km.MXWeight) -> int:
    return sum(a.nbytes for a in (w.w, w.scales, w.row_scale) if a is not None)


def kernels(args) -> dict:
    m, dtype = _mlx()
    rng = np.random.default_rng(0)
    bw0 = copy_rate(COPY_GIB)
    rows = []
    expert = [_mxfp4(rng, K3_INTER, K3_LATENT), _mxfp4(rng, K3_INTER, K3_LATENT), _mxfp4(rng, K3_LATENT, K3_INTER)]
    ebytes = sum(_nbytes(w) for w in expert)
    for T in TOKENS:
        x = m.random.normal((T, K3_LATENT)).astype(dtype)

        def step(x=x):
            g, u = km.linear(x, expert[0]), km.linear(x, expert[1])
            return km.linear(km.activation(g, u, K3_ACT), expert[2])

        s = _timed(step, args.seconds)
        rows.append({"case": f"k3 expert mxfp4 x{T} tok", "tokens": T, "weight_bytes": ebytes,
                     "GBps": ebytes / s / 1e9})
    for o, i in INT8_SHAPES:
        w = _int8(rng, o, i, dtype)
        x = m.random.normal((1, i)).astype(dtype)
        s = _timed(lambda x=x, w=w: km.linear(x, w), args.seconds)
        rows.append({"case": f"int8 {o}x{i} x1 tok ({'affine 8-bit' if w.quantized else 'bf16 rows'})", "tokens": 1,
                     "weight_bytes": _nbytes(w), "GBps": _nbytes(w) / s / 1e9})
    layer = _k3_layer_step(dtype, args.seconds)
    bw = max(bw0, copy_rate(COPY_GIB))
    for r in rows + [layer]:
        r["over_copy_rate"] = r["GBps"] / bw
    rec = {"bench": "kernels", "device": "mlx", "mlx_device": m.default_device().type.name,
           "activations": str(dtype).rsplit(".", 1)[-1], "copy_GBps": bw, "copy_GBps_before_after": [bw0, bw],
           "cases": rows, "k3_layer_step": layer}
    print(f"kernels (mlx on {rec['mlx_device']}, {rec['activations']} activations): device copy rate "
          f"{bw:.2f} GB/s (read + write, measured in this run)")
    for r in rows:
        print(f"  {r['case']:<40} {r['GBps']:7.2f} GB/s of weight bytes = {r['over_copy_rate']:.3f} of the copy rate")
    print(f"  k3 one-token expert step: {layer['experts']} experts in one gather_qmm pass from the slab, "
          f"{layer['seconds'] * 1e3:.1f} ms, {layer['GBps']:.2f} GB/s = {layer['over_copy_rate']:.3f} of the copy rate")
    if rec["mlx_device"] == "cpu":
        print("  (MLX's CPU build: reference BLAS on about one thread; no speed target here, the ratios are a Mac's)")
    _json(args, rec)
    return rec


def _k3_layer_step(dtype, seconds: float, k: int = 16) -> dict:
    """One token's 16 routed K3 experts of a layer from a slab of 16 + 4 slots, by slot index, SiTU-GLU."""
    from deltafin.bench.synthetic import random_expert
    from deltafin.mlx.slab import ExpertSlab
    from deltafin.store import expert_file as ef

    m = km.mx()
    data = ef.encode(random_expert(np.random.default_rng(1), K3_LATENT, K3_INTER), 0, 0)
    slab = ExpertSlab(k + 4, len(data))
    slots, views = [], None
    for _ in range(k):
        buf = slab.get(len(data))
        buf[: len(data)] = data
        t = ef.decode(buf[: len(data)])
        slots.append(slab.slot_of(t["gate"].data))
        views = views or slab.views(t)
    idx = m.array(np.array([slots], dtype=np.uint32))  # [1, k]
    x = m.random.normal((1, K3_LATENT)).astype(dtype)
    s = _timed(lambda: km.glu(x, views, idx, K3_ACT), seconds)
    payload = k * sum(v.data[0].nbytes + v.scales[0].nbytes for v in views.values())
    return {"experts": k, "weight_bytes": payload, "seconds": s, "GBps": payload / s / 1e9}


def decode(args) -> dict:
    """The synthetic K3 decode through the MLX source: reads into the slab, experts multiplied in place."""
    from deltafin.bench.decode import xxh3_gbps
    from deltafin.bench.synthetic import synthetic_run
    from deltafin.mlx.source import MLXExperts

    m, dtype = _mlx()
    verify = getattr(args, "verify_reads", True)
    with synthetic_run(args, "decode", inflight=min(args.threads, args.k)) as run_:
        pm = run_.pm
        source = MLXExperts(pm, 0, args.threads, verify=verify)
        rng = random.Random(args.seed)
        routes = [{L: sorted(rng.sample(range(pm.num_experts), args.k)) for L in pm.moe_layers}
                  for _ in range(args.tokens)]
        x = m.random.normal((1, run_.latent)).astype(dtype)
        t0 = time.perf_counter()
        for step in routes:
            for L, ids in step.items():
                slot_of, views = source.slots(L, ids)
                y = None
                if not args.io_only:
                    y = km.glu(x, views, m.array(np.array([[slot_of[e] for e in ids]], dtype=np.uint32)), K3_ACT)
                    m.async_eval(y)
                source.mlx_slab.fence(y)
        m.synchronize()
        wall = time.perf_counter() - t0
        st = source.stats
        source.close()
        raw, nbytes = run_.remeasure(), run_.nbytes
    read = st.bytes_read / wall / 1e9
    rec = {"bench": "decode", "device": "mlx", "mlx_device": m.default_device().type.name,
           "mode": "io-only" if args.io_only else "full", "tokens": args.tokens, "moe_layers": args.layers,
           "experts": args.experts, "k": args.k, "expert_file_bytes": nbytes, "bytes_read": st.bytes_read,
           "seconds": wall, "tok_s": args.tokens / wall, "read_GBps": read, "raw_GBps": raw,
           "raw_GBps_before_after": run_.probes, "efficiency": read / raw, "direct_io": source.direct,
           "verify_reads": verify, "xxh3_GBps": xxh3_gbps(nbytes), "slab_waits": source.mlx_slab.waits}
    print(f"decode (mlx on {rec['mlx_device']}, {rec['mode']}): {rec['tok_s']:.2f} tok/s over {args.tokens} tokens x "
          f"{args.layers} layers x {args.k} experts of {nbytes / 1e6:.1f} MB read into the MLX slab; read "
          f"{read:.2f} GB/s = {rec['efficiency']:.2f} of the drive's raw {raw:.2f} GB/s measured in this run"
          f"{'' if source.direct else ' (buffered: the filesystem refused direct I/O)'}")
    if rec["mlx_device"] == "cpu":
        print("  (MLX's CPU build: the expert math runs on reference BLAS; no speed target here)")
    _json(args, rec)
    return rec


def _mlx():
    """(mlx.core, the activations' dtype: bfloat16 on the GPU, float32 on MLX's CPU build); refused without MLX."""
    why = km.available()
    if why:
        from deltafin.errors import UsageError

        raise UsageError(f"--device mlx: {why}")
    m = km.mx()
    return m, m.bfloat16 if m.default_device().type == m.DeviceType.gpu else m.float32


def _json(args, rec: dict) -> None:
    if getattr(args, "json", None):
        from deltafin.store.manifest import write_json_atomic

        write_json_atomic(args.json, rec)
