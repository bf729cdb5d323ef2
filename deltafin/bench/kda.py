"""KDA chunked prefill: the batched form beside the per-chunk reference and the floors measured in the same run.

``python -m deltafin.bench.kda --device cuda --tokens 4096 32768 --heads 96 --json OUT``. Inputs are random
at the given widths (float32, decays from K3's lower-bound gate). For each length: the batched
``kda.chunked`` and the per-chunk ``kda.chunked_reference`` (the former default), the largest difference
between them, and two floors measured on the same device: the form's matmul FLOPs at the measured float32
GEMM rate, and its unavoidable bytes (q, k, v, g, beta in; o out) at the measured device copy rate.
``--parts`` also times the pieces of one segment (in-chunk products, WY inverse, state loop); on CUDA the
fused Triton products are timed beside the torch form. ``--slice``
also times the K3 slice prefill (``deltafin bench prefill --synthetic k3-slice``) with the per-chunk form,
the figure to set beside that command's own run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from deltafin.models import kda

BOUND = -5.0  # K3's gate_lower_bound


def inputs(T: int, H: int, K: int, V: int, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    g0 = torch.Generator(device).manual_seed(seed)

    def rn(*shape):
        return torch.randn(*shape, generator=g0, device=device)

    q, k = kda.l2norm(rn(T, H, K)) * K**-0.5, kda.l2norm(rn(T, H, K))
    g = kda.lower_bound_gate(2 * rn(T, H, K), (torch.rand(H, generator=g0, device=device) * 15 + 1).log(), BOUND)
    beta = torch.rand(T, H, generator=g0, device=device)
    return [q, k, rn(T, H, V), g, beta, torch.zeros(H, K, V, device=device)]


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of fn over reps runs, after one untimed run."""
    fn()
    out = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_rate(device: torch.device, n: int = 4096) -> float:
    """float32 matmul FLOP/s (full float32, no TF32) of an n x n x n product."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    return 2 * n**3 / timed(lambda: a @ b, device, 5)


def copy_rate(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes moved (read + written) per second by a device-to-device copy."""
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device, 5)


def flops(T: int, H: int, K: int, V: int, c: int = kda.CHUNK, sub: int = kda.SUB) -> int:
    """Matmul FLOPs of the batched form: in-chunk products, WY factors, state loop and output."""
    n = c // sub
    per = 4 * sub * sub * K * n * (n + 1) // 2 + 2 * c * c * (K + V) + 6 * c * K * V + 2 * c * c * V
    return -(-T // c) * H * per


def _rel_diff(a, b) -> float:
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b, strict=True))


def run_length(T: int, H: int, K: int, V: int, device: torch.device, reps: int, rates: tuple[float, float]
               ) -> dict:
    x = inputs(T, H, K, V, device)
    new = timed(lambda: kda.chunked(*x, gate_bound=BOUND), device, reps)
    old = timed(lambda: kda.chunked_reference(*x), device, 1)
    ref = kda.chunked_reference(*x)
    f_floor = flops(T, H, K, V) / rates[0]
    b_floor = 4 * T * H * (3 * K + 2 * V + 1) / rates[1]
    r = {"tokens": T, "new_s": new, "old_s": old, "speedup": old / new,
         "max_rel_diff": _rel_diff(kda.chunked(*x, gate_bound=BOUND), ref),
         "flop_floor_s": f_floor, "byte_floor_s": b_floor, "floor_ratio": new / max(f_floor, b_floor)}
    if device.type == "cuda":
        from deltafin.kernels import cuda as kc

        variants = {"products": {"products": kc.kda_products}}
        for name, kw in variants.items():
            try:
                r[f"triton_{name}_s"] = timed(lambda kw=kw: kda.chunked(*x, gate_bound=BOUND, **kw), device, reps)
                r[f"triton_{name}_rel_diff"] = _rel_diff(kda.chunked(*x, gate_bound=BOUND, **kw), ref)
            except Exception as e:  # the compiler refuses the tiles (shared memory, registers)
                r[f"triton_{name}_error"] = str(e)[:200]
    return r


def slice_prefill(tokens: int, layers: int, experts: int) -> dict:
    """The K3 slice prefill with the per-chunk KDA form swapped in (the figure before the batched form)."""
    from deltafin.bench import k3_slice_gpu

    batched = kda.chunked
    kda.chunked = lambda q, k, v, g, beta, S, chunk=kda.CHUNK, *_: kda.chunked_reference(q, k, v, g, beta, S, chunk)
    try:
        a = argparse.Namespace(layers=layers, experts=experts, json=None, smoke=False, tokens=0, torch_steps=0,
                               prefill=[tokens])
        return k3_slice_gpu.run(a, "prefill")[f"prefill_{tokens}"]
    finally:
        kda.chunked = batched


def parts(T: int, H: int, K: int, V: int, device: torch.device, reps: int) -> dict:
    """Seconds of the pieces of one segment, and a batched triangular solve for comparison with the inverse."""
    q, k, v, g, beta, S = inputs(T, H, K, V, device)
    c, sub = kda.CHUNK, kda.SUB
    N = T // c
    qb, kb, vb, gb = (kda._blocks(t, N, c) for t in (q, k, v, g))
    bb = kda._blocks(beta, N, c).unsqueeze(-1)
    G = gb.cumsum(2)
    Akk, _ = kda._intra(qb, kb, G, sub)
    L = (bb * Akk).tril(-1)
    M = kda.unit_lower_inverse(L, sub)
    W, U = M @ (kb * G.exp()), M @ vb
    kd = (kb * (G[:, :, -1:] - G).exp()).transpose(-1, -2)
    dec = G[:, :, -1:].transpose(-1, -2).exp()
    rhs = torch.cat([kb, vb], -1)
    return {
        "blocks_s": timed(lambda: [kda._blocks(t, N, c) for t in (q, k, v, g)], device, reps),
        "intra_s": timed(lambda: kda._intra(qb, kb, G, sub), device, reps),
        "inverse_s": timed(lambda: kda.unit_lower_inverse(L, sub), device, reps),
        "wy_s": timed(lambda: (M @ (kb * G.exp()), M @ vb), device, reps),
        "solve_triangular_s": timed(
            lambda: torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True), device, reps),
        "states_s": timed(lambda: kda._states(W, U, kd, dec, S), device, reps),
        "products_s": timed(lambda: kda._products(qb, kb, G, bb, sub), device, reps),
    } | (_fused_parts(qb, kb, G, bb, sub, device, reps) if device.type == "cuda" else {})


def _fused_parts(q, k, G, b, sub, device, reps) -> dict:
    from deltafin.kernels import cuda as kc

    return {"products_triton_s": timed(lambda: kc.kda_products(q, k, G, b, sub), device, reps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--dim", type=int, default=128, help="key and value width per head")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--slice", type=int, default=0, metavar="TOKENS",
                    help="also the K3 slice prefill of TOKENS with the per-chunk form (CUDA)")
    ap.add_argument("--layers", type=int, default=5, help="slice layers (with --slice)")
    ap.add_argument("--experts", type=int, default=32, help="slice experts per layer (with --slice)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 path stays float32
    rates = (gemm_rate(dev), copy_rate(dev))
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "heads": a.heads,
           "dim": a.dim, "gemm_flop_s": rates[0], "copy_byte_s": rates[1], "lengths": []}
    print(f"KDA chunked on {res['device']}, H={a.heads}, K=V={a.dim}, float32: GEMM {rates[0] / 1e12:.1f} TFLOP/s, "
          f"copy {rates[1] / 1e9:.0f} GB/s (measured)")
    for T in a.tokens:
        r = run_length(T, a.heads, a.dim, a.dim, dev, a.reps, rates)
        res["lengths"].append(r)
        print(f"T={T}: batched {r['new_s'] * 1e3:.2f} ms vs per-chunk {r['old_s'] * 1e3:.1f} ms "
              f"({r['speedup']:.1f}x); floor {max(r['flop_floor_s'], r['byte_floor_s']) * 1e3:.2f} ms "
              f"(FLOPs {r['flop_floor_s'] * 1e3:.2f}, bytes {r['byte_floor_s'] * 1e3:.2f}): "
              f"{r['floor_ratio']:.1f}x the floor; max rel diff {r['max_rel_diff']:.1e}"
              + "".join(f"; Triton {k[7:-2]}: {v * 1e3:.2f} ms (diff {r[k[:-2] + '_rel_diff']:.1e})"
                        for k, v in r.items() if k.startswith("triton_") and k.endswith("_s")))
        _save(a.json, res)
    if a.parts:
        res["parts"] = parts(min(a.tokens), a.heads, a.dim, a.dim, dev, a.reps)
        print("parts (ms): " + ", ".join(f"{k[:-2]} {v * 1e3:.2f}" for k, v in res["parts"].items()))
        _save(a.json, res)
    if a.slice:
        res["slice_per_chunk_form"] = slice_prefill(a.slice, a.layers, a.experts)
        _save(a.json, res)
    return 0


def _save(path: str | None, res: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    raise SystemExit(main())
