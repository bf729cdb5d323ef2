"""CUDA kernel benchmark: every Triton kernel checked against the float32 reference, tuned, and timed.

Run on a CUDA machine: ``python -m deltafin.bench.kernels_cuda --json OUT.json``. In one process:

1. The limit: device-to-device copy bandwidth (bytes read + bytes written per second), measured first.
2. Correctness of every kernel (MXFP4 by integer decode and by Triton's scaled dot, int8, INT4 group 32;
   linear and grouped experts; bf16 and float32 activations; 1 to 300 tokens; odd row counts) against
   dequantize-then-matmul in float64 on the same random data, as ||out - ref|| / ||ref||.
3. A sweep of block configurations for the decode shapes, keeping the fastest that passed its check.
4. Timings (``triton.testing.do_bench`` medians, several weight copies rotated so nothing sits in L2):
   the 16-expert Kimi K3 MXFP4 step at 1, 8 and 64 tokens, the K3 int8 trunk GEMVs, prefill GEMMs, each as
   weight bytes / time over the copy rate, with the plain-torch path (dequantize, then matmul) beside it.
5. The decode GEMV kernels (``kernels/triton_gemv.py``) beside the tensor-core ones: the MoE step at 1 and
   8 tokens, the int8 trunk shapes at 1 token (``bench/kernels_gemv.py``; ``--gemv`` runs only this part).
The last lines printed are the summary table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback

import torch

# Kimi K3 widths (../specs/KIMI_K3.md): hidden 7168, latent 3584, expert intermediate 3072.
HID, LAT, INTER = 7168, 3584, 3072
# The int8 trunk GEMVs of one decode step: (name, out, in, count per layer kind).
KDA_SHAPES = [("kda.in", 4 * 12288 + 128 + 96, HID, 1), ("kda.o", HID, 12288, 1), ("kda.f_b", 12288, 128, 1)]
MLA_SHAPES = [("mla.in", 1536 + 576 + 12288, HID, 1), ("mla.q_b", 96 * 192, 1536, 1), ("mla.kv_b", 96 * 256, 512, 1),
              ("mla.o", HID, 12288, 1)]
TUNE_INT8_SHAPES = [("kda.qkvg", 12288, HID, 1), ("kda.o", HID, 12288, 1), ("mla.q_a", 1536, HID, 1),
                    ("mla.kv_b", 96 * 256, 512, 1)]
MOE_TRUNK_SHAPES = [("moe.router", 896, HID, 1), ("moe.side", LAT + 2 * 6144, HID, 1), ("moe.latent_up", HID, LAT, 1),
                    ("moe.shared_down", HID, 6144, 1)]


PREFILL_T = 4096
CHECK_SHAPES = ((1, 1000, 1536), (7, 257, 3584), (64, 96, 512), (300, 576, 1024))  # (T, out, in)
SMOKE = False  # --smoke: tiny widths on the CPU under TRITON_INTERPRET=1 (checks this script, not speed)


def _bench(fn, reps_ms: int = 200) -> float:
    import triton.testing

    if SMOKE:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return triton.testing.do_bench(fn, warmup=25, rep=reps_ms, return_mode="median") * 1e-3  # seconds


def _graph(fn):
    """fn captured in a CUDA graph (launch gaps out of the figure); the replay callable."""
    if SMOKE:
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def copy_gbps(dev) -> float:
    n = (2 << 30) if not SMOKE else 1 << 20
    a = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
    b = torch.empty_like(a)
    t = _bench(lambda: b.copy_(a))
    return 2 * n / t / 1e9


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm()).item()


def _mx(out: int, inp: int, dev, copies: int = 1):
    """Random MXFP4 weights: every code, scales near 2^0 as in trained weights."""
    p = torch.randint(0, 256, (copies, out, inp // 2), dtype=torch.uint8, device=dev)
    s = torch.randint(118, 131, (copies, out, inp // 32), dtype=torch.uint8, device=dev)
    return p, s


def _weights(fmt: str, out: int, inp: int, dev, copies: int = 1):
    """(packed, scales, dequantized float32 of copy 0) for a format."""
    from deltafin.quant import int4, int8, mxfp4

    if fmt == "mxfp4":
        p, s = _mx(out, inp, dev, copies)
        return p, s, mxfp4.dequantize(p[0], s[0])
    if fmt == "int8":
        q = torch.randint(-127, 128, (copies, out, inp), dtype=torch.int8, device=dev)
        s = torch.rand(copies, out, device=dev) * 0.02 + 0.001
        return q, s, int8.dequantize(q[0], s[0])
    p = torch.randint(-2**31, 2**31 - 1, (copies, out, inp // 8), dtype=torch.int32, device=dev)
    s = (torch.rand(copies, out, inp // 32, device=dev) * 0.02 + 0.001).to(torch.bfloat16)
    return p, s, int4.dequantize(p[0], s[0])


def _fn(fmt: str):
    from deltafin.kernels import triton as K

    return {"mxfp4": K.mxfp4_linear, "int8": K.int8_linear, "int4g32": K.int4g32_linear}[fmt]


def check_linear(dev) -> list[dict]:
    """Each linear kernel vs float64 dequantize-then-matmul; bf16 x is rounded before the reference, so the
    error is the kernel's own (float32 accumulation, the output's rounding)."""
    rows = []
    for fmt in ("mxfp4", "int8", "int4g32"):
        for T, N, Kd in CHECK_SHAPES:
            p, s, w = _weights(fmt, N, Kd, dev)
            for dt in (torch.bfloat16, torch.float32):
                for scaled in ((False, True) if fmt == "mxfp4" and dt == torch.bfloat16 else (None,)):
                    x = torch.randn(T, Kd, device=dev).to(dt)
                    ref = x.double() @ w.double().T
                    cfg = None
                    if scaled is not None:
                        from deltafin.kernels.triton import linear_config
                        cfg = dict(linear_config(fmt, T, N, Kd), scaled=scaled)
                    try:
                        err = _rel(_fn(fmt)(x, p[0], s[0], cfg), ref)
                    except Exception as e:  # a variant that does not compile is reported, not fatal
                        err, note = math.inf, f"{type(e).__name__}: {str(e)[:200]}"
                    else:
                        note = ""
                    lim = 1e-5 if dt == torch.float32 else 8e-3
                    rows.append({"kernel": f"{fmt}_linear" + ("/scaled" if scaled else ""), "T": T, "N": N,
                                 "K": Kd, "dtype": str(dt).split(".")[-1], "rel_err": err, "limit": lim,
                                 "ok": err <= lim, "note": note})
    return rows


def _expert_set(fmt: str, n: int, dev):
    """n K3-size experts as a slab, and their float32 weights for the reference (first few only)."""
    from deltafin.kernels.triton_moe import ExpertSlab
    from deltafin.quant.record import QTensor

    ex = []
    for _ in range(n):
        t = {}
        for r, (o, i) in {"gate": (INTER, LAT), "up": (INTER, LAT), "down": (LAT, INTER)}.items():
            p, s, _ = _weights(fmt, o, i, dev) if fmt != "mxfp4" else (*_mx(o, i, dev), None)
            t[r] = QTensor(fmt, (o, i), p[0], s[0])
        ex.append(t)
    return ExpertSlab.stack(ex, dev), ex


def _moe_ref(x, ids, wts, ex, act):
    from deltafin.quant.record import dequantize

    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    xd = x.double()
    for e in ids.unique().tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        w = {r: dequantize(t).double() for r, t in ex[e].items()}
        g, u = xd[tok] @ w["gate"].T, xd[tok] @ w["up"].T
        a = (torch.nn.functional.silu(g) * u if act == 0 else
             4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25))
        out.index_add_(0, tok, (a @ w["down"].T) * wts[tok, j].double().unsqueeze(-1))
    return out


def check_moe(dev) -> list[dict]:
    from deltafin.kernels.triton_moe import grouped_glu, moe_config

    rows = []
    for fmt in ("mxfp4", "int4g32"):
        slab, ex = _expert_set(fmt, 8, dev)
        for T, k in ((1, 8), (5, 4), (64, 6)):
            ids = torch.stack([torch.randperm(8, device=dev)[:k] for _ in range(T)])
            wts = torch.rand(T, k, device=dev)
            for dt in (torch.bfloat16, torch.float32):
                x = (torch.randn(T, LAT, device=dev) * 0.5).to(dt)
                for act in (0, 1):
                    ref = _moe_ref(x, ids, wts, ex, act)
                    for scaled in ((False, True) if fmt == "mxfp4" and dt == torch.bfloat16 else (None,)):
                        cfg = dict(moe_config(T * k, len(ids.unique()), LAT, INTER), scaled=bool(scaled))
                        note = ""
                        try:
                            err = _rel(grouped_glu(x, ids, wts, slab, act, cfg=cfg), ref)
                        except Exception as e:
                            err, note = math.inf, f"{type(e).__name__}: {str(e)[:200]}"
                        # bf16: the activations between the two kernels are rounded to bf16 too
                        lim = 1e-5 if dt == torch.float32 else 1.5e-2
                        rows.append({"kernel": f"grouped_{fmt}" + ("/scaled" if scaled else ""), "T": T, "k": k,
                                     "act": ["silu", "situ"][act], "dtype": str(dt).split(".")[-1],
                                     "rel_err": err, "limit": lim, "ok": err <= lim, "note": note})
    return rows


def _linear_cfgs():
    out = []
    for bn, bk, w, st, sm in ((32, 128, 4, 3, 1), (64, 128, 4, 3, 1), (64, 256, 4, 3, 1), (128, 128, 4, 3, 1),
                              (32, 256, 4, 4, 1), (64, 256, 8, 4, 1), (64, 128, 4, 3, 2), (32, 256, 4, 3, 2),
                              (16, 512, 4, 3, 1), (128, 256, 8, 3, 1)):
        out.append({"BN": bn, "BK": bk, "num_warps": w, "num_stages": st, "split_mult": sm})
    return out


def _cfg_for(base: dict, fmt: str, T: int, N: int, Kd: int, scaled=None) -> dict:
    import triton

    bt = 16
    progs = triton.cdiv(N, base["BN"])
    bk = base["BK"]
    splits = max(1, min(triton.cdiv(264 * base["split_mult"], progs), max(1, Kd // bk // 2)))
    k_per = triton.cdiv(triton.cdiv(Kd, splits), bk) * bk
    return {"BT": bt, "BN": base["BN"], "BK": bk, "num_warps": base["num_warps"],
            "num_stages": base["num_stages"], "splits": triton.cdiv(Kd, k_per), "k_per_split": k_per,
            "scaled": scaled}


def tune_linear(dev, fmt: str, shapes, dt=torch.bfloat16, scaled=None) -> dict:
    """Best config over the decode shapes (sum of times, graph replays), each config checked first."""
    results = []
    data = {}
    for name, N, Kd, _n in shapes:
        copies = max(1, min(8, int(400e6 // (N * Kd))))
        p, s, w = _weights(fmt, N, Kd, dev, copies)
        x = torch.randn(1, Kd, device=dev).to(dt)
        data[name] = (p, s, x, x.double() @ w.double().T, copies, N, Kd)
    for base in _linear_cfgs():
        total, ok, per = 0.0, True, {}
        try:
            for name, (p, s, x, ref, copies, N, Kd) in data.items():
                cfg = _cfg_for(base, fmt, 1, N, Kd, scaled)
                f = _fn(fmt)
                if _rel(f(x, p[0], s[0], cfg), ref) > 8e-3:
                    ok = False
                    break
                run = _graph(lambda f=f, p=p, s=s, x=x, cfg=cfg, c=copies: [f(x, p[i], s[i], cfg) for i in range(c)])
                per[name] = _bench(run) / copies
                total += per[name]
        except Exception as e:
            results.append({"cfg": base, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            continue
        results.append({"cfg": base, "ok": ok, "total_s": total if ok else None, "per_shape_s": per})
    good = [r for r in results if r.get("ok")]
    best = min(good, key=lambda r: r["total_s"]) if good else None
    return {"format": fmt, "scaled": scaled, "sweep": results, "best": best}


def _moe_cfgs(T: int):
    bts = [16] if T <= 8 else [16, 64]
    out = []
    for bt in bts:
        for bn, bk, w, st in ((64, 256, 4, 3), (32, 256, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3)):
            if bt == 64 and bk > 128:
                continue
            for scaled in (False, True):
                out.append({"BT": bt, "BN": bn, "BK": bk, "num_warps": w, "num_stages": st, "BN_down": bn,
                            "BK_down": bk, "scaled": scaled})
    return out


def moe_step(dev, slabs, exs, T: int, gbps: float, tune: bool) -> dict:
    """The 16-expert K3 MXFP4 step: every token routed to all 16 experts (k = 16), so the step reads each
    expert once whatever T; expert bytes / time over the copy rate. Slabs are rotated (several copies)."""
    from deltafin.kernels.triton_moe import grouped_glu, moe_config, plan_moe
    from deltafin.quant.record import matmul

    k = 16
    ids = torch.arange(k, device=dev).repeat(T, 1)
    wts = torch.rand(T, k, device=dev)
    x = torch.randn(T, LAT, device=dev).to(torch.bfloat16)
    nbytes = sum(q.nbytes for t in exs[0] for q in t.values())
    ref = _moe_ref(x, ids, wts, exs[0], 1) if T <= 8 else None
    cands = _moe_cfgs(T) if tune else [dict(moe_config(T * k, k, LAT, INTER))]
    rows = []
    for cfg in cands:
        try:
            if ref is not None and _rel(grouped_glu(x, ids, wts, slabs[0], 1, cfg=cfg), ref) > 1.5e-2:
                rows.append({"cfg": cfg, "ok": False})
                continue
            pl = plan_moe(ids, dev, LAT, INTER, cfg)
            run = _graph(lambda pl=pl: [grouped_glu(x, None, wts, sl, 1, plan=pl) for sl in slabs])
            t = _bench(run) / len(slabs)
        except Exception as e:
            rows.append({"cfg": cfg, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            continue
        rows.append({"cfg": cfg, "ok": True, "s": t, "GBps": nbytes / t / 1e9, "ratio": nbytes / t / 1e9 / gbps})
    good = [r for r in rows if r.get("ok")]
    best = min(good, key=lambda r: r["s"]) if good else None
    # the plain torch path: each expert dequantized to bf16, then matmuls (today's per-expert path)
    def torch_path():
        for e in range(k):
            t = exs[0][e]
            g, u = matmul(x, t["gate"]), matmul(x, t["up"])
            matmul(4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25), t["down"])
    tt = _bench(torch_path)
    return {"T": T, "expert_bytes": nbytes, "best": best, "sweep": rows, "torch_s": tt,
            "torch_ratio": nbytes / tt / 1e9 / gbps}


def time_trunk(dev, fmt_cfg: dict | None, gbps: float) -> dict:
    """int8 GEMV at every K3 trunk shape (T = 1), kernel vs torch path, graph replays over rotated copies."""
    from deltafin.quant import int8

    rows = []
    for name, N, Kd, n in KDA_SHAPES + MLA_SHAPES + MOE_TRUNK_SHAPES:
        copies = max(1, min(8, int(400e6 // (N * Kd))))
        q, s, _ = _weights("int8", N, Kd, dev, copies)
        x = torch.randn(1, Kd, device=dev).to(torch.bfloat16)
        cfg = _cfg_for(fmt_cfg, "int8", 1, N, Kd) if fmt_cfg else None
        f = _fn("int8")
        t = _bench(_graph(lambda f=f, x=x, q=q, s=s, cfg=cfg, c=copies: [f(x, q[i], s[i], cfg) for i in range(c)]))
        t /= copies
        tt = _bench(_graph(lambda x=x, q=q, s=s, c=copies: [int8.matmul(x, q[i], s[i]) for i in range(c)])) / copies
        nb = N * Kd + 4 * N
        rows.append({"shape": name, "N": N, "K": Kd, "count": n, "s": t, "GBps": nb / t / 1e9,
                     "ratio": nb / t / 1e9 / gbps, "torch_s": tt, "torch_ratio": nb / tt / 1e9 / gbps})
    return {"rows": rows}


def time_prefill(dev) -> list[dict]:
    """Prefill GEMMs (T = 4096): int8 trunk and MXFP4 expert shapes vs torch bf16 matmul on plain weights."""
    out = []
    T = PREFILL_T
    for fmt, N, Kd in (("int8", 12288, HID), ("mxfp4", INTER, LAT), ("mxfp4", LAT, INTER)):
        p, s, w = _weights(fmt, N, Kd, dev)
        x = torch.randn(T, Kd, device=dev).to(torch.bfloat16)
        f = _fn(fmt)
        err = _rel(f(x, p[0], s[0]), x.double() @ w.double().T)
        t = _bench(lambda f=f, x=x, p=p, s=s: f(x, p[0], s[0]))
        wb = w.to(torch.bfloat16)
        tb = _bench(lambda x=x, wb=wb: x @ wb.T)
        fl = 2 * T * N * Kd
        out.append({"fmt": fmt, "T": T, "N": N, "K": Kd, "rel_err": err, "s": t, "TFLOPs": fl / t / 1e12,
                    "bf16_matmul_TFLOPs": fl / tb / 1e12, "ratio_to_bf16": tb / t})
    return out


def prefill_moe(dev, slab, gbps) -> dict:
    """Expert-major prefill: 4096 tokens over 64 experts, top 16 (the k3-slice layer), one grouped call."""
    from deltafin.kernels.triton_moe import grouped_glu, plan_moe

    T, E, k = PREFILL_T, slab.slots, 16
    ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)])
    wts = torch.rand(T, k, device=dev)
    x = torch.randn(T, LAT, device=dev).to(torch.bfloat16)
    best = None
    for bt, bn, bk, w in ((64, 128, 64, 8), (64, 64, 128, 4), (128, 128, 64, 8), (64, 128, 128, 8)):
        cfg = {"BT": bt, "BN": bn, "BK": bk, "BN_down": bn, "BK_down": bk, "num_warps": w, "num_stages": 3}
        for scaled in (False, True):
            c = dict(cfg, scaled=scaled)
            try:
                pl = plan_moe(ids, dev, LAT, INTER, c)
                t = _bench(lambda pl=pl: grouped_glu(x, None, wts, slab, 1, plan=pl), 300)
            except Exception as e:
                print("prefill moe cfg failed", c, type(e).__name__, str(e)[:120])
                continue
            if best is None or t < best["s"]:
                best = {"cfg": c, "s": t}
    fl = 2 * T * k * 3 * INTER * LAT
    best["TFLOPs"] = fl / best["s"] / 1e12
    best["tok_s_per_layer"] = T / best["s"]
    return best


def _shrink() -> None:
    global SMOKE, HID, LAT, INTER, KDA_SHAPES, MLA_SHAPES, MOE_TRUNK_SHAPES, _linear_cfgs, PREFILL_T, CHECK_SHAPES
    global TUNE_INT8_SHAPES
    SMOKE, HID, LAT, INTER, PREFILL_T = True, 128, 64, 96, 40
    CHECK_SHAPES = ((1, 40, 64), (20, 17, 96))
    KDA_SHAPES = [("kda.qkvg", 96, HID, 4)]
    MLA_SHAPES = [("mla.kv_b", 48, 64, 1)]
    MOE_TRUNK_SHAPES = [("moe.router", 17, HID, 1)]
    TUNE_INT8_SHAPES = KDA_SHAPES
    _linear_cfgs = lambda: [{"BN": 32, "BK": 64, "num_warps": 4, "num_stages": 3, "split_mult": 1}]  # noqa: E731


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="no tuning sweep")
    ap.add_argument("--smoke", action="store_true", help="tiny widths on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--gemv", action="store_true", help="only the decode GEMV kernels beside the tensor-core ones")
    a = ap.parse_args(argv)
    if a.smoke:
        _shrink()
    dev = torch.device("cpu" if a.smoke else "cuda")
    res: dict = {"device": "cpu (smoke)" if a.smoke else torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    res["triton"] = triton.__version__
    t0 = time.time()

    def save():
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1, default=str)

    def section(name, fn):
        try:
            res[name] = fn()
        except Exception:
            res[name] = {"error": traceback.format_exc()[-2000:]}
            print(f"[{name}] FAILED\n{res[name]['error']}")
        print(f"[{name}] done at {time.time() - t0:.0f} s", flush=True)
        save()

    section("copy_GBps", lambda: copy_gbps(dev))
    gbps = res["copy_GBps"]
    if a.gemv:
        from deltafin.bench import kernels_gemv

        section("gemv_int8", lambda: kernels_gemv.int8(sys.modules[__name__], dev, gbps))
        gsets = [_expert_set("mxfp4", 16, dev) for _ in range(1 if SMOKE else 4)]
        section("gemv_moe", lambda: kernels_gemv.moe(sys.modules[__name__], dev, [s for s, _ in gsets],
                                                     [e for _, e in gsets], gbps, (1,) if a.quick else (1, 8)))
        save()
        print("\n".join(kernels_gemv.summary(res, gbps)))
        return 0
    section("check_linear", lambda: check_linear(dev))
    section("check_moe", lambda: check_moe(dev))
    if not a.quick:
        section("tune_int8", lambda: tune_linear(dev, "int8", TUNE_INT8_SHAPES))
        section("tune_mxfp4", lambda: tune_linear(dev, "mxfp4", [("e.gate", INTER, LAT, 1), ("e.down", LAT, INTER, 1)]))
        section("tune_mxfp4_scaled", lambda: tune_linear(dev, "mxfp4", [("e.gate", INTER, LAT, 1),
                                                                        ("e.down", LAT, INTER, 1)], scaled=True))
    best8 = (res.get("tune_int8") or {}).get("best") if isinstance(res.get("tune_int8"), dict) else None
    section("trunk_int8", lambda: time_trunk(dev, best8["cfg"] if best8 else None, gbps))
    sets = [_expert_set("mxfp4", 16, dev) for _ in range(4)]
    slabs, exs = [s for s, _ in sets], [e for _, e in sets]
    for T in (1, 8, 64):
        section(f"moe_T{T}", lambda T=T, sl=slabs, ex=exs: moe_step(dev, sl, ex, T, gbps, tune=not a.quick))
    from deltafin.bench import kernels_gemv

    section("gemv_moe", lambda sl=slabs, ex=exs: kernels_gemv.moe(sys.modules[__name__], dev, sl, ex, gbps, (1, 8)))
    section("gemv_int8", lambda: kernels_gemv.int8(sys.modules[__name__], dev, gbps))
    del sets, slabs, exs
    section("prefill_gemm", lambda: time_prefill(dev))
    section("prefill_moe", lambda: prefill_moe(dev, _expert_set("mxfp4", 64, dev)[0], gbps))
    save()
    _summary(res, gbps)
    return 0


def _summary(res: dict, gbps: float) -> None:
    print(f"\n=== summary (limit: device-to-device copy {gbps:.0f} GB/s, same run) ===")
    for name in ("check_linear", "check_moe"):
        rows = res.get(name)
        if isinstance(rows, list):
            bad = [r for r in rows if not r["ok"]]
            worst = max((r["rel_err"] for r in rows if r["ok"]), default=float("nan"))
            print(f"{name}: {len(rows) - len(bad)}/{len(rows)} pass (worst passing rel err {worst:.2e})")
            for r in bad:
                print("  FAIL", {k: v for k, v in r.items() if k != "ok"})
    for T in (1, 8, 64):
        m = res.get(f"moe_T{T}")
        if isinstance(m, dict) and m.get("best"):
            b = m["best"]
            print(f"moe 16 experts T={T}: {b['s'] * 1e3:.3f} ms, {b['GBps']:.0f} GB/s = {b['ratio']:.2f} of copy "
                  f"(target >= 0.5 at T=1); torch path {m['torch_s'] * 1e3:.2f} ms = {m['torch_ratio']:.3f}; "
                  f"cfg {b['cfg']}")
    tr = res.get("trunk_int8")
    if isinstance(tr, dict) and "rows" in tr:
        nb = sum((r["N"] * r["K"] + 4 * r["N"]) * r["count"] for r in tr["rows"])
        ts = sum(r["s"] * r["count"] for r in tr["rows"])
        tt = sum(r["torch_s"] * r["count"] for r in tr["rows"])
        for r in tr["rows"]:
            print(f"  int8 {r['shape']:<20} {r['N']:>6}x{r['K']:<6} {r['s'] * 1e6:8.1f} us  {r['ratio']:.2f} of copy "
                  f"(torch {r['torch_ratio']:.2f})")
        print(f"int8 trunk GEMV all K3 shapes: {nb / ts / 1e9:.0f} GB/s = {nb / ts / 1e9 / gbps:.2f} of copy "
              f"(target >= 0.6); torch path {nb / tt / 1e9 / gbps:.2f}")
    for k in ("tune_int8", "tune_mxfp4", "tune_mxfp4_scaled"):
        t = res.get(k)
        if isinstance(t, dict) and t.get("best"):
            print(f"{k}: best {t['best']['cfg']} total {t['best']['total_s'] * 1e6:.1f} us")
    pg = res.get("prefill_gemm")
    if isinstance(pg, list):
        for r in pg:
            print(f"prefill {r['fmt']} {r['N']}x{r['K']} T={r['T']}: {r['TFLOPs']:.0f} TFLOP/s "
                  f"(bf16 matmul {r['bf16_matmul_TFLOPs']:.0f}), rel err {r['rel_err']:.1e}")
    pm = res.get("prefill_moe")
    if isinstance(pm, dict) and "s" in pm:
        print(f"prefill moe 4096 tok x 16 of 64 experts: {pm['s'] * 1e3:.1f} ms = {pm['TFLOPs']:.0f} TFLOP/s, "
              f"{pm['tok_s_per_layer']:.0f} tok/s per layer; cfg {pm['cfg']}")
    from deltafin.bench import kernels_gemv

    print("\n".join(kernels_gemv.summary(res, gbps)))


if __name__ == "__main__":
    raise SystemExit(main())
