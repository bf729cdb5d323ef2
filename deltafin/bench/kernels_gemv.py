"""The decode GEMV kernels (``kernels/triton_gemv.py``) beside the tensor-core kernels they may replace.

Part of ``deltafin.bench.kernels_cuda`` (``--gemv`` runs this part alone): the 16-expert Kimi K3 MXFP4 step
at 1 and 8 tokens and the int8 trunk GEMVs at 1 token, each block configuration checked against the float64
reference first, then timed as CUDA-graph replays over rotated weight copies; every figure is weight bytes
per second over the device-to-device copy rate measured in the same run.
"""

from __future__ import annotations

import contextlib
from types import ModuleType

import torch

# ``moe_gemv_config`` arguments; the gate/up and down kernels may take their own tiles and warps. The H200 sweeps
# over BN 8-64 x BK 256-1024 x 2-8 warps put BN 8-16 x BK 512 at 4 warps first (float32 decode 0.28 of copy at
# T=1; packed fp16 decode 2 0.46-0.48); dependent launches gave ~2% (0.49); timed alone, the tile gate/up ran best
# at BK 256 with 2 warps (0.54 of copy) and down at BN 4 with 4 warps (0.48); the unrolled kernels at gate/up BN 8 x
# BK 256, 2 warps (0.61) and down BN 4 x BK 128, 1 warp (0.52; 0.27-0.48 at 18 other tiles). These are the finalists.
_OLD = dict(BK=512, num_warps=4, BN_down=8, BK_down=512, num_warps_down=4, unrolled=False, unrolled_down=False)
_TILE = dict(unrolled=False, unrolled_down=False)  # the tile kernels' split tiles, the default before the unrolled
MOE_CFGS = (dict(_OLD, BN=16, BN_down=16, decode=0, pdl=False), dict(_OLD, pdl=False), dict(_OLD), dict(_TILE),
            dict(_TILE, BN_down=8), dict(_TILE, prefetch=1), dict(), dict(unrolled_down=False),
            dict(BK=512, num_warps=4), dict(pf_rows_down=0), dict(BN_down=8, BK_down=256, num_warps_down=2))


# (BN, BK, num_warps, num_stages, target programs for split-K, magic int8 conversion); an earlier sweep of
# BN 8-32 x BK 256-1024 x 4-8 warps x 264-1056 programs with the conversion instruction left these.
INT8_CFGS = ((8, 512, 4, 3, 528, False), (8, 512, 4, 3, 528, True), (16, 256, 4, 3, 1056, True),
             (8, 1024, 4, 3, 1056, True), (16, 512, 4, 3, 528, True), (8, 256, 4, 3, 1056, True))


@contextlib.contextmanager
def _flags_off():
    """The tensor-core kernels' own configs, whatever the GEMV flags say."""
    from deltafin.kernels import triton_gemv as G

    saved = G.GEMV_INT8, G.GEMV_MOE
    G.GEMV_INT8 = G.GEMV_MOE = False
    try:
        yield
    finally:
        G.GEMV_INT8, G.GEMV_MOE = saved


def moe(kc: ModuleType, dev, slabs, exs, gbps: float, Ts=(1,)) -> list[dict]:
    """Every token routed to all 16 experts (k = 16): each expert's bytes are read once per step. kc: the
    running ``kernels_cuda`` module (its widths, shrunk by --smoke, and timing helpers)."""
    from deltafin.kernels.triton_gemv import moe_gemv_config
    from deltafin.kernels.triton_moe import grouped_glu, moe_config, plan_moe

    k, lat, inter = 16, kc.LAT, kc.INTER
    nbytes = sum(q.nbytes for t in exs[0] for q in t.values())
    out = []
    for T in Ts[:1 if kc.SMOKE else None]:
        ids = torch.arange(k, device=dev).repeat(T, 1)
        wts = torch.rand(T, k, device=dev)
        x = torch.randn(T, lat, device=dev).to(torch.bfloat16)
        ref = kc._moe_ref(x, ids, wts, exs[0], 1)
        with _flags_off():
            cands = [("tensor-core", moe_config(T * k, k, lat, inter))]
        cfgs = [c for c in MOE_CFGS if not (kc.SMOKE and c.get("decode", 2) == 2)]  # (packed fp16: PTX, GPU only)
        cands += [("gemv", moe_gemv_config(**c)) for c in cfgs[:2 if kc.SMOKE else None]]
        for kind, cfg in cands:
            def check(cfg=cfg, x=x, ids=ids, wts=wts, ref=ref):
                return kc._rel(grouped_glu(x, ids, wts, slabs[0], 1, cfg=cfg), ref)

            def timed(cfg=cfg, x=x, ids=ids, wts=wts):
                pl = plan_moe(ids, dev, lat, inter, cfg)
                return kc._bench(kc._graph(lambda: [grouped_glu(x, None, wts, sl, 1, plan=pl) for sl in slabs]),
                                 100) / len(slabs)

            out.append(_measured({"T": T, "kernel": kind, "cfg": cfg}, check, timed, 1.5e-2, nbytes, gbps))
    return out


def _measured(row: dict, check, timed, tol: float, nbytes: int, gbps: float) -> dict:
    """row with the kernel's error against the reference (``check()``), its seconds per call (``timed()``) and
    bytes per second over the copy rate; a configuration that fails to compile or run is reported in the row,
    not raised."""
    try:
        row["rel_err"] = check()
        t = timed()
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        return row
    row.update(ok=row["rel_err"] <= tol, s=t, ratio=nbytes / t / 1e9 / gbps)
    return row


def int8(kc: ModuleType, dev, gbps: float) -> list[dict]:
    """Every K3 trunk shape at T = 1: the tensor-core kernel's default config and each GEMV config."""
    from deltafin.kernels import triton as K
    from deltafin.kernels.triton_gemv import int8_gemv_config

    out = []
    for name, N, Kd, n in kc.KDA_SHAPES + kc.MLA_SHAPES + kc.MOE_TRUNK_SHAPES:
        copies = max(1, min(8, int(400e6 // (N * Kd))))
        q, s, w = kc._weights("int8", N, Kd, dev, copies)
        x = torch.randn(1, Kd, device=dev).to(torch.bfloat16)
        ref = x.double() @ w.double().T
        nb = N * Kd + 4 * N
        cands = [("tensor-core", K.linear_config("int8", 1, N, Kd))]
        cands += [("gemv", int8_gemv_config(N, Kd, bn, bk, wp, st, tg, mg))
                  for bn, bk, wp, st, tg, mg in INT8_CFGS[:2 if kc.SMOKE else None]]
        cands += [("default", None)]  # what the model's linears take (GEMV up to INT8_MAX_WEIGHTS)
        for i, (kind, cfg) in enumerate(cands):
            row = {"shape": name, "N": N, "K": Kd, "count": n, "kernel": kind, "cfg_index": i, "cfg": cfg}
            out.append(_measured(
                row, lambda cfg=cfg, x=x, q=q, s=s, ref=ref: kc._rel(K.int8_linear(x, q[0], s[0], cfg), ref),
                lambda cfg=cfg, c=copies, x=x, q=q, s=s: kc._bench(kc._graph(
                    lambda: [K.int8_linear(x, q[j], s[j], cfg) for j in range(c)]), 100) / c, 8e-3, nb, gbps))
    return out


def summary(res: dict, gbps: float) -> list[str]:
    """Compact table lines: MoE per T (tensor-core vs best GEMV), int8 bytes-weighted over the shapes."""
    lines = [f"--- GEMV kernels (limit: device-to-device copy {gbps:.0f} GB/s, same run) ---"]
    rows = res.get("gemv_moe")
    if isinstance(rows, list):
        for T in sorted({r["T"] for r in rows}):
            for r in (r for r in rows if r["T"] == T):
                c = r["cfg"]
                tag = (f"{'unrolled ' if c.get('unrolled') else ''}BN {c['BN']} BK {c['BK']} w {c['num_warps']} dec {c.get('decode', '-')}"
                       f" pf {c.get('prefetch', '-')} pdl {int(c['pdl']) if 'pdl' in c else '-'}"
                       + (f" down{' unrolled' if c.get('unrolled_down') else ''} {c['BN_down']}x{c['BK_down']} w {c['num_warps_down']}"
                          if "num_warps_down" in c else ""))
                fig = (f"{r['s'] * 1e3:.3f} ms = {r['ratio']:.2f} of copy, err {r['rel_err']:.1e}"
                       + ("" if r["ok"] else " FAIL")) if "s" in r else r.get("error", "")
                lines.append(f"moe T={T} {r['kernel']:<11} {tag:<50} {fig}")
    rows = res.get("gemv_int8")
    if isinstance(rows, list):
        ok = [r for r in rows if r.get("ok")]
        shapes = {(r["shape"], r["N"], r["K"], r["count"]) for r in rows}
        nb = sum((N * Kd + 4 * N) * n for _, N, Kd, n in shapes)
        for i in sorted({r["cfg_index"] for r in ok if r["kernel"] != "default"}):
            sel = [r for r in ok if r["cfg_index"] == i]
            if len(sel) == len(shapes):
                ts = sum(r["s"] * r["count"] for r in sel)
                c = sel[0]["cfg"]
                lines.append(f"int8 T=1 cfg {i} {sel[0]['kernel']:<11} BN {c['BN']} BK {c['BK']} w {c['num_warps']}"
                             f" target {INT8_CFGS[i - 1][4] if i else '-'} magic {c.get('magic', '-')}: {nb / ts / 1e9 / gbps:.2f} of copy "
                             f"bytes-weighted; worst shape {min(r['ratio'] for r in sel):.2f}")
        from deltafin.kernels.triton_gemv import INT8_MAX_WEIGHTS

        sel = [r for r in ok if r["kernel"] == "default"]
        if len(sel) == len(shapes):
            ts = sum(r["s"] * r["count"] for r in sel)
            lines.append(f"int8 T=1 default (GEMV up to {INT8_MAX_WEIGHTS / 1e6:.0f}M weights, tensor-core above): "
                         f"{nb / ts / 1e9 / gbps:.2f} of copy bytes-weighted over the decode step's shapes (target "
                         f">= 0.6); worst shape {min(r['ratio'] for r in sel):.2f}")
        best = {}
        for r in ok:
            if r["kernel"] == "gemv" and (r["shape"] not in best or r["s"] < best[r["shape"]]["s"]):
                best[r["shape"]] = r
        for r in best.values():
            old = next((o["ratio"] for o in ok if o["shape"] == r["shape"] and o["cfg_index"] == 0), float("nan"))
            lines.append(f"  int8 {r['shape']:<20} {r['N']:>6}x{r['K']:<6} tensor-core {old:.2f}, "
                         f"best gemv {r['ratio']:.2f} (cfg {r['cfg_index']})")
    return lines
