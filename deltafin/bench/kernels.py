"""``deltafin bench kernels``: weight matmuls at Kimi K3's shapes, GB/s of weight bytes beside memory bandwidth.

Cases: one K3 routed expert (MXFP4 gate/up [3072, 3584], down [3584, 3072]; 17.5 MB) at 1 token and a few
tokens, as three matmuls (the target's figure) and, beside, as the one call the engine makes for it where the
backend has one (gate, up, SiTU-GLU, down: ``kernels.glu``), and the int8 trunk's GEMV shapes (KDA q/k/v/g
[12288, 7168], o [7168, 12288], shared experts [6144, 7168] and [7168, 6144], latent down [3584, 7168]).
Prefill rows: the same expert at 64 and 128 tokens (a layer's share of a 512-token prompt), and the int8 trunk's
[12288, 7168] and [6144, 7168] at 128 tokens (the int16 GEMM past GEMM_TOKENS too), in GFLOP/s beside
the machine's int16 dot-product peak measured in the same run (before and after them, the higher kept), with
the tiled float path (``DELTAFIN_CPU_GEMM=0``) and a float32 torch matmul of the same shapes (weights already
float) beside. The gated expert (gate, up, SiTU-GLU, down in one call) at bench prefill's 85 tokens per
expert, on one thread and on all, each over the int16 peak of as many threads. Each case cycles over enough copies
of its weights to overflow the last-level cache, so every byte comes from memory. The limit, measured in the same run before
and after the cases (the higher is kept): on the CPU the read rate of a sum over a 1 GiB tensor on all
threads; on CUDA a device-to-device copy (bytes read + written). The plain torch path's figure is beside.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from deltafin.bench.synthetic import K3_ACT, K3_INTER, K3_LATENT
from deltafin.quant.record import QTensor

INT8_SHAPES = [(12288, 7168), (7168, 12288), (6144, 7168), (7168, 6144), (3584, 7168)]
EXPERT_TOKENS = (1, 4, 32)
PREFILL_TOKENS = (64, 128)
TARGET = 0.5  # achieved / bandwidth at one token
PREFILL_TARGET = 2.5  # the GEMM over the tiled float path at prefill token counts
# the int8 trunk at prefill: KDA's q/k/v/g and a shared expert's up (the largest two shapes), a layer's 128 tokens
PREFILL_INT8 = ((12288, 7168), (6144, 7168))
PREFILL_INT8_TOKENS = 128


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bandwidth(device: str, gib: float = 1.0, reps: int = 3) -> float:
    """Best GB/s over ``reps``: a sum over a tensor far larger than the CPU's caches, or a device copy."""
    n = int(gib * (1 << 30)) // 4
    a = torch.ones(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a) if device == "cuda" else None
    best = 0.0
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        if b is None:
            a.sum()
        else:
            b.copy_(a)
        _sync(device)
        best = max(best, (1 if b is None else 2) * n * 4 / (time.perf_counter() - t) / 1e9)
    return best


def _copies(make: Callable[[], list[QTensor]], nbytes: int, cache_bytes: int) -> list[list[QTensor]]:
    """Enough copies of one case's weights (distinct memory) that cycling over them overflows the caches."""
    base = make()
    n = max(2, -(-2 * cache_bytes // nbytes))
    return [base] + [[QTensor(w.format, w.shape, w.data.clone(), w.scale.clone()) for w in base] for _ in range(n - 1)]


def _rate(run: Callable[[list[QTensor]], object], sets: list[list[QTensor]], nbytes: int, device: str,
          min_s: float) -> float:
    """GB/s of weight bytes: cycle over the copies until at least ``min_s`` has passed (one warm-up pass)."""
    run(sets[0])
    _sync(device)
    done, t = 0, time.perf_counter()
    while True:
        for ws in sets:
            run(ws)
            done += 1
        _sync(device)
        dt = time.perf_counter() - t
        if dt >= min_s:
            return done * nbytes / dt / 1e9


def _cache_bytes() -> int:
    """The last-level cache size (Linux sysfs), or 256 MiB when it cannot be read."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    for d in os.listdir(base) if os.path.isdir(base) else []:
        try:
            with open(f"{base}/{d}/size") as f:
                s = f.read().strip()
            best = max(best, int(s[:-1]) * {"K": 1 << 10, "M": 1 << 20}[s[-1]] if s[-1] in "KM" else int(s))
        except (OSError, ValueError):
            continue
    return best or 256 << 20


def _i8(out: int, inn: int, g: torch.Generator, device: str) -> QTensor:
    q = torch.randint(-127, 128, (out, inn), dtype=torch.int8, generator=g)
    return QTensor("int8", (out, inn), q, torch.rand(out, generator=g) / 127).to(device)


def _cases(device: str) -> list[tuple[str, int, Callable[[], list[QTensor]]]]:
    g = torch.Generator().manual_seed(0)

    def mx(out: int, inn: int) -> QTensor:
        packed = torch.randint(0, 256, (out, inn // 2), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 124, (out, inn // 32), dtype=torch.uint8, generator=g)
        return QTensor("mxfp4", (out, inn), packed, scales).to(device)

    expert = lambda: [mx(K3_INTER, K3_LATENT), mx(K3_INTER, K3_LATENT), mx(K3_LATENT, K3_INTER)]  # noqa: E731
    cases = [(f"k3 expert mxfp4 x{t} tok", t, expert) for t in EXPERT_TOKENS]
    cases += [(f"int8 {o}x{i} x1 tok", 1, (lambda o=o, i=i: [_i8(o, i, g, device)])) for o, i in INT8_SHAPES]
    return cases


def _prefill_rows(device: str, seconds: float, rounds: int = 3) -> list[dict]:
    """The K3 expert at prefill token counts, and the int8 trunk's largest shapes at PREFILL_INT8_TOKENS: GFLOP/s of
    the fast path, of the tiled float path, and of a float32 torch matmul on already-float weights (what the tiled
    path's BLAS could reach at best). The three alternate over ``rounds`` rounds and each keeps its best, so a
    shared machine's load shifts them alike. The expert's rows carry the GEMM's target over the tiled path."""
    from deltafin.kernels import fast
    from deltafin.quant.record import dequantize

    expert = _cases(device)[0][2]()
    g = torch.Generator().manual_seed(1)
    cases = [(f"k3 expert mxfp4 x{T} tok", expert, T, PREFILL_TARGET) for T in PREFILL_TOKENS]
    cases += [(f"int8 {o}x{i} x{PREFILL_INT8_TOKENS} tok", [_i8(o, i, g, device)], PREFILL_INT8_TOKENS, None)
              for o, i in PREFILL_INT8]
    rows = []
    for name, ws, T, target in cases:
        flop1 = 2 * sum(w.shape[0] * w.shape[1] for w in ws)  # per token
        wf = [dequantize(w) for w in ws]
        x = torch.randn(T, ws[0].shape[1], device=device)
        xi = torch.randn(T, ws[-1].shape[1], device=device)
        run_ = functools.partial(_expert_run, x=x, xi=xi)
        mm = functools.partial(lambda _, x, xi, wf: (x @ wf[0].T, x @ wf[1].T, xi @ wf[2].T) if len(wf) == 3
                               else x @ wf[0].T, x=x, xi=xi, wf=wf)
        fused = tile = blas = 0.0
        for _ in range(rounds):
            with fast():
                fused = max(fused, _rate(run_, [ws], flop1 * T, device, seconds / rounds))
                with _env("DELTAFIN_CPU_GEMM", "0"):
                    tile = max(tile, _rate(run_, [ws], flop1 * T, device, seconds / rounds))
            blas = max(blas, _rate(mm, [ws], flop1 * T, device, seconds / rounds / 2))
        rows.append({"case": name, "tokens": T, "fused_GFLOPs": fused, "tile_GFLOPs": tile,
                     "f32_matmul_GFLOPs": blas, "fused_over_tile": fused / tile, "target_over_tile": target})
        del wf
    return rows


GLU_TOKENS = 85  # bench prefill's mean tokens per expert (512 x 16 routes over 96 experts)


def _glu_rows(device: str, seconds: float, rounds: int = 3) -> list[dict]:
    """The K3 gated expert (SiTU-GLU, one fused call) at GLU_TOKENS tokens beside the three separate GEMMs of the same
    expert, each over the int16 dot-product peak of the same thread count measured in the same rounds: on one thread
    (a core's peak, steady) and on all (a peak that moves with where a VM's vCPUs land). Alternating rounds, best
    of each. Empty where the fused expert does not run (no VNNI GEMM in this build)."""
    from deltafin.kernels import fast, glu, native

    lib = native.library() if device == "cpu" else None
    ws = _cases(device)[0][2]()
    x = torch.randn(GLU_TOKENS, ws[0].shape[1], device=device)
    act = K3_ACT
    with fast():
        if lib is None or not lib.df_gw_peak(1, 1) or glu(x, *ws, act) is None:
            return []
    flop = 2 * sum(w.shape[0] * w.shape[1] for w in ws) * GLU_TOKENS
    xi = torch.randn(GLU_TOKENS, ws[-1].shape[1], device=device)
    all_threads, rows = torch.get_num_threads(), []
    for nt in sorted({1, all_threads}):
        torch.set_num_threads(nt)
        try:
            peak = fused = sep = 0.0
            for _ in range(rounds):
                peak = max(peak, lib.df_gw_peak(nt, 2_000_000 // nt))
                with fast():
                    fused = max(fused, _rate(lambda _: glu(x, *ws, act), [ws], flop, device, seconds / rounds / 2))
                    sep = max(sep, _rate(functools.partial(_expert_run, x=x, xi=xi), [ws], flop, device,
                                         seconds / rounds / 2))
        finally:
            torch.set_num_threads(all_threads)
        rows.append({"case": f"k3 gated expert x{GLU_TOKENS} tok", "tokens": GLU_TOKENS, "threads": nt,
                     "int16_peak_GOPs": peak, "fused_GFLOPs": fused, "three_gemms_GFLOPs": sep,
                     "fused_over_peak": fused / peak, "three_gemms_over_peak": sep / peak})
    return rows


def _mla_row(device: str, seconds: float) -> dict | None:
    """Kimi K3's one-token MLA absorbed projections (96 heads, kv_b_proj int8 [96 x 256, 512]: q through W_uk,
    the attention's output through W_uv, the attention itself left out): the fast path's per-head int8 GEMVs
    against the torch form, which widens kv_b to float every step. GB/s of kv_b's 12.6 MB a token."""
    from deltafin import kernels
    from deltafin.models import mla

    if device != "cpu":
        return None
    H, dn, dv, R = 96, 128, 128, 512
    g = torch.Generator().manual_seed(3)
    w = _i8(H * (dn + dv), R, g, device)
    qn, o = torch.randn(1, H, dn, generator=g), torch.randn(1, H, R, generator=g)
    with kernels.fast():
        if kernels.mla_absorbed_cpu(qn, w, dn, dv) is None:
            return None

        def fast():
            q_lat, out = kernels.mla_absorbed_cpu(qn, w, dn, dv)
            out(o)

        t_fast = _median_call(fast, seconds)

    def plain():
        w_uk, w_uv = mla.split_kv_b(w, H, dn, dv, torch.float32)
        torch.bmm(qn.transpose(0, 1), w_uk)
        torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2))

    t_plain = _median_call(plain, seconds / 4)
    return {"case": "k3 mla absorbed x1 tok", "weight_bytes": w.nbytes, "fused_GBps": w.nbytes / t_fast / 1e9,
            "torch_GBps": w.nbytes / t_plain / 1e9, "fused_ms": t_fast * 1e3, "torch_ms": t_plain * 1e3}


def _median_call(fn: Callable[[], object], seconds: float) -> float:
    fn()
    ts, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(ts) < 3:
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def int16_peak(device: str) -> float:
    """The int16 dot-product peak on the fast path's threads (GOP/s), the best of three short runs; 0 off the CPU or
    where the kernels have no VNNI code."""
    from deltafin.kernels import native

    lib = native.library() if device == "cpu" else None
    if lib is None:
        return 0.0
    return max(lib.df_gw_peak(torch.get_num_threads(), 2_000_000) for _ in range(3))


def _expert_run(ws: list[QTensor], x: torch.Tensor, xi: torch.Tensor) -> None:
    from deltafin.kernels import matmul

    if len(ws) == 3:  # gate, up, down: the down projection takes the intermediate width
        matmul(x, ws[0])
        matmul(x, ws[1])
        matmul(xi, ws[2])
    else:
        matmul(x, ws[0])


def run(args) -> dict:
    from deltafin import kernels

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        from deltafin.errors import UsageError

        raise UsageError("--device cuda: no CUDA device is available to torch here; use --device cpu")
    if getattr(args, "isa", None):
        os.environ["DELTAFIN_CPU_ISA"] = args.isa  # every native.library() call from here on builds for it
    from deltafin.kernels import cpu

    isa = cpu.isa() if device == "cpu" and cpu.available() else None
    bw0 = bandwidth(device)
    llc = _cache_bytes() if device == "cpu" else 0
    rows = []
    for name, T, make in _cases(device):
        ws0 = make()
        nbytes = sum(w.nbytes for w in ws0)
        sets = _copies(lambda ws0=ws0: ws0, nbytes, llc) if llc else [ws0]
        x = torch.randn(T, ws0[0].shape[1], device=device)
        xi = torch.randn(T, ws0[-1].shape[1], device=device)
        run_ = functools.partial(_expert_run, x=x, xi=xi)
        with kernels.fast():
            fast = _rate(run_, sets, nbytes, device, args.seconds)
            # the expert as the engine runs it where the backend has one call for it (gate, up, K3's SiTU-GLU, down)
            one_call = (_rate(lambda ws, x=x: kernels.glu(x, *ws, K3_ACT), sets, nbytes, device, args.seconds)
                        if len(ws0) == 3 and kernels.glu(x, *ws0, K3_ACT) is not None else None)
        ref = _rate(run_, sets[:1], nbytes, device, args.seconds / 4)
        rows.append({"case": name, "tokens": T, "weight_bytes": nbytes, "fused_GBps": fast, "torch_GBps": ref,
                     "one_call_GBps": one_call})
        del sets, ws0
    # the int16 peak before and after the GEMM rows, the higher kept (as the bandwidth): a VM's vCPUs move between
    # one core's two hyperthreads and two whole cores, and the ratio against a peak caught in the low state would
    # read past 1
    mla_row = _mla_row(device, args.seconds)
    peak0 = int16_peak(device)
    gemm = device == "cpu" and cpu.available() and cpu.gemm_enabled()  # builds without it: the tiled float path
    prefill = _prefill_rows(device, args.seconds) if gemm else []
    glu_rows = _glu_rows(device, args.seconds) if gemm else []
    peak = max(peak0, int16_peak(device))
    for r in prefill:
        r["fused_over_peak"] = r["fused_GFLOPs"] / peak if peak else None
    bw = max(bw0, bandwidth(device))
    if mla_row:
        mla_row |= {"fused_over_bandwidth": mla_row["fused_GBps"] / bw, "torch_over_bandwidth": mla_row["torch_GBps"] / bw}
    for r in rows:
        r["fused_over_bandwidth"] = r["fused_GBps"] / bw
        r["torch_over_bandwidth"] = r["torch_GBps"] / bw
        r["one_call_over_bandwidth"] = r["one_call_GBps"] / bw if r["one_call_GBps"] else None
    one = [r for r in rows if r["tokens"] == 1]
    result = {"bench": "kernels", "device": device, "backend": kernels.backend_name(device), "isa": isa,
              "threads": torch.get_num_threads(), "bandwidth_GBps": bw,
              "bandwidth_GBps_before_after": [bw0, bw], "last_level_cache_bytes": llc, "cases": rows,
              "worst_one_token_fraction": min(r["fused_over_bandwidth"] for r in one), "target": TARGET,
              "int16_peak_GOPs": peak, "int16_peak_GOPs_before_after": [peak0, peak], "prefill": prefill,
              "prefill_target": PREFILL_TARGET, "gated_expert": glu_rows, "mla": mla_row,
              "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    _print(result)
    if args.json:
        from deltafin.store.manifest import write_json_atomic

        write_json_atomic(args.json, result)
    return result


def _print(r: dict) -> None:
    isa = f" ({r['isa']})" if r.get("isa") else ""
    print(f"kernels ({r['device']}, backend {r['backend']}{isa}, {r['threads']} threads): memory read bandwidth "
          f"{r['bandwidth_GBps']:.2f} GB/s measured in this run ({'sum over 1 GiB' if r['device'] == 'cpu' else 'device copy'})")
    for c in r["cases"]:
        mark = f" (target >= {r['target']})" if c["tokens"] == 1 else ""
        one = (f"; as one call with the activation (the engine's expert) {c['one_call_GBps']:6.2f} GB/s = "
               f"{c['one_call_over_bandwidth']:.2f}" if c.get("one_call_GBps") else "")
        print(f"  {c['case']:<28} fused {c['fused_GBps']:6.2f} GB/s = {c['fused_over_bandwidth']:.2f} of bandwidth"
              f"{mark}; plain torch {c['torch_GBps']:6.3f} GB/s = {c['torch_over_bandwidth']:.3f}{one}")
    if r.get("mla"):
        m = r["mla"]
        print(f"  {m['case']:<28} fused {m['fused_GBps']:6.2f} GB/s = {m['fused_over_bandwidth']:.2f} of bandwidth "
              f"({m['fused_ms']:.2f} ms); plain torch (kv_b widened every step) {m['torch_GBps']:6.3f} GB/s = "
              f"{m['torch_over_bandwidth']:.3f} ({m['torch_ms']:.1f} ms)")
    print(f"worst one-token case: {r['worst_one_token_fraction']:.2f} of memory bandwidth (target >= {r['target']})")
    if r["device"] == "cpu" and not r["prefill"]:
        print("prefill: this build has no int16 GEMM (AVX-512 VNNI and VBMI, or AVX2); many-token matmuls take the "
              "tiled float path")
    if r["prefill"]:
        print(f"prefill: int16 dot-product peak {r['int16_peak_GOPs']:.0f} GOP/s (the higher of before and after "
              f"the rows below, measured in this run); load average {r['load_average']:.1f}")
    for c in r["prefill"]:
        of_peak = f" = {c['fused_over_peak']:.2f} of peak" if c["fused_over_peak"] else ""
        print(f"  {c['case']:<28} fused {c['fused_GFLOPs']:6.1f} GFLOP/s{of_peak}; tiled float path "
              f"{c['tile_GFLOPs']:6.1f}: x{c['fused_over_tile']:.2f}"
              + (f" (target >= {c['target_over_tile']})" if c.get("target_over_tile") else "") + "; float32 "
              f"matmul {c['f32_matmul_GFLOPs']:6.1f}")
    for c in r.get("gated_expert", []):
        print(f"  {c['case']:<28} {c['threads']} thread(s): one fused call {c['fused_GFLOPs']:6.1f} GFLOP/s = "
              f"{c['fused_over_peak']:.2f} of the int16 peak {c['int16_peak_GOPs']:.0f} GOP/s on as many threads "
              f"measured beside it; three GEMMs {c['three_gemms_GFLOPs']:6.1f} = {c['three_gemms_over_peak']:.2f}")
