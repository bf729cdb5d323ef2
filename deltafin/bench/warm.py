"""``deltafin bench warm``: decode of a mid-size MoE with every expert in memory, beside the memory roofline.

A random Qwen3-MoE (hidden 2048, 6 layers, 32 experts of width 768, top-8, 32 query / 4 KV heads, vocabulary
32,768) built straight as records: int8 trunk (per-row scales), MXFP4 experts. Nothing is read from a drive,
so the step is pure math. The roofline is the memory read bandwidth measured in the same run divided by the
bytes one token touches (every trunk matrix, the lm_head, and its 8 experts in each layer); target >= 0.3.
"""

from __future__ import annotations

import time

import torch

from deltafin.bench.kernels import bandwidth
from deltafin.quant.record import QTensor

CONFIG = {"vocab_size": 32768, "hidden_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 32,
          "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": 768, "intermediate_size": 6144,
          "num_experts": 32, "num_experts_per_tok": 8, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
          "rope_theta": 1e6, "max_position_embeddings": 4096, "decoder_sparse_step": 1, "mlp_only_layers": []}
TARGET = 0.3


def build(seed: int = 0) -> tuple[dict[str, QTensor], dict[tuple[int, int], dict[str, QTensor]]]:
    """(trunk records, experts by (layer, id)): random int8 weights scaled like a trained model's
    (rows of unit-variance inputs give unit-variance outputs), MXFP4 experts with E8M0 scales near 2^-6."""
    c, g = CONFIG, torch.Generator().manual_seed(seed)
    D, H, Hk, d, I, E = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                         c["moe_intermediate_size"], c["num_experts"])

    def i8(out: int, inn: int) -> QTensor:
        q = torch.randint(-127, 128, (out, inn), dtype=torch.int8, generator=g)
        return QTensor("int8", (out, inn), q, torch.full((out,), 1.0 / (73 * inn**0.5)))

    def mx(out: int, inn: int) -> QTensor:
        packed = torch.randint(0, 256, (out, inn // 2), dtype=torch.uint8, generator=g)
        return QTensor("mxfp4", (out, inn), packed, torch.randint(118, 122, (out, inn // 32), dtype=torch.uint8,
                                                                   generator=g))

    ones = lambda n: QTensor("f32", (n,), torch.ones(n))  # noqa: E731
    w = {"model.embed_tokens.weight": i8(c["vocab_size"], D), "model.norm.weight": ones(D),
         "lm_head.weight": i8(c["vocab_size"], D)}
    experts = {}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": ones(D), p + "post_attention_layernorm.weight": ones(D),
              p + "self_attn.q_proj.weight": i8(H * d, D), p + "self_attn.k_proj.weight": i8(Hk * d, D),
              p + "self_attn.v_proj.weight": i8(Hk * d, D), p + "self_attn.o_proj.weight": i8(D, H * d),
              p + "self_attn.q_norm.weight": ones(d), p + "self_attn.k_norm.weight": ones(d),
              p + "mlp.gate.weight": i8(E, D)}
        for e in range(E):
            experts[(i, e)] = {"gate": mx(I, D), "up": mx(I, D), "down": mx(D, I)}
    return w, experts


def bytes_per_token(w: dict[str, QTensor], experts: dict) -> int:
    """Every trunk matrix is read once per token (the embedding: one row); each layer reads k experts."""
    c = CONFIG
    trunk = sum(t.nbytes for n, t in w.items() if n != "model.embed_tokens.weight")
    one = sum(t.nbytes for t in experts[(0, 0)].values())
    return trunk + w["model.embed_tokens.weight"].nbytes // c["vocab_size"] + c["num_hidden_layers"] * c[
        "num_experts_per_tok"] * one


def _sync(model) -> None:
    if model.device.type == "cuda":  # the GPU's work is asynchronous: time it to its end
        torch.cuda.synchronize(model.device)


def _decode(model, experts, tokens: int, fast: bool) -> float:
    """Seconds per token over ``tokens`` one-token steps after two warm-up steps (greedy feedback)."""
    from deltafin import kernels

    state = model.new_state(tokens + 8)
    tok = torch.tensor([1], device=model.device)
    with torch.inference_mode(), kernels.fast(fast):
        for n in range(tokens + 2):
            if n == 2:
                _sync(model)
                t = time.perf_counter()
            tok = model.forward(tok, state, experts)[-1:].argmax(-1)
    _sync(model)
    return (time.perf_counter() - t) / tokens


def invariance_cost(model, experts, tokens: int, batch: int = 8, prompt: int = 128) -> dict:
    """Fast-path seconds with and without batch invariance (``kernels.batch_invariant``): a one-sequence decode
    token, a step of ``batch`` sequences, a ``prompt``-token prefill. Interleaved, best of two rounds each."""
    from deltafin import kernels
    from deltafin.runtime.batch import forward_batch

    def timed(fn, reps: int) -> float:
        fn()  # warm-up
        _sync(model)
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(model)
        return (time.perf_counter() - t) / reps

    def batched() -> float:
        states = [model.new_state(tokens + 8) for _ in range(batch)]
        seqs = lambda: [(torch.tensor([1 + j], device=model.device), st) for j, st in enumerate(states)]  # noqa: E731
        return timed(lambda: forward_batch(model, seqs(), experts), tokens)

    def prefill() -> float:
        ids = torch.arange(1, prompt + 1, device=model.device)
        return timed(lambda: model.forward(ids, model.new_state(prompt + 1), experts), 1)

    best: dict[bool, dict[str, float]] = {}
    for _ in range(2):
        for inv in (False, True):
            with torch.inference_mode(), kernels.batch_invariant(inv), kernels.fast(True):
                got = {"decode_s": _decode(model, experts, tokens, True), "batch_step_s": batched(),
                       "prefill_s": prefill()}
            best[inv] = {k: min(v, best.get(inv, {}).get(k, v)) for k, v in got.items()}
    return {"batch": batch, "prompt": prompt, "default": best[False], "batch_invariant": best[True],
            "cost": {k: best[True][k] / best[False][k] - 1 for k in best[False]}}


def run(args) -> dict:
    from deltafin import kernels
    from deltafin.models import qwen3_moe
    from deltafin.models.base import ResidentExperts
    from deltafin.runtime.engine import compute_dtype, resolve_device

    device = resolve_device(args.device)
    dtype = compute_dtype(args.exact, args.dtype, device)
    w, ex = build()
    per_tok = bytes_per_token(w, ex)
    bw0 = bandwidth(args.device)
    model = qwen3_moe.Model(qwen3_moe.Config.from_dict(CONFIG), w, device=device, dtype=dtype)
    experts = ResidentExperts(ex, device)
    step = _decode(model, experts, args.tokens, not args.exact)
    ref_model = model if dtype == torch.float32 else qwen3_moe.Model(qwen3_moe.Config.from_dict(CONFIG), w, device)
    ref_step = _decode(ref_model, experts, 2, False)
    bw = max(bw0, bandwidth(args.device))
    roof = bw * 1e9 / per_tok
    r = {"bench": "warm", "device": args.device, "path": "exact" if args.exact else kernels.backend_name(device.type),
         "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(), "bytes_per_token": per_tok,
         "bandwidth_GBps": bw, "roofline_tok_s": roof, "tok_s": 1 / step, "fraction_of_roofline": 1 / step / roof,
         "torch_path_tok_s": 1 / ref_step, "torch_fraction_of_roofline": 1 / ref_step / roof, "target": TARGET,
         "tokens": args.tokens}
    print(f"warm decode ({args.device}, {r['path']}, {r['dtype']}, {r['threads']} threads): {r['tok_s']:.2f} tok/s = "
          f"{r['fraction_of_roofline']:.2f} of the memory roofline {roof:.2f} tok/s ({bw:.2f} GB/s read bandwidth "
          f"in this run / {per_tok / 1e6:.0f} MB per token; target >= {TARGET}); plain torch path "
          f"{r['torch_path_tok_s']:.3f} tok/s = {r['torch_fraction_of_roofline']:.3f}")
    if getattr(args, "batch_invariant", False) and r["path"] in ("cpu", "triton"):
        inv = r["invariance"] = invariance_cost(model, experts, args.tokens)
        d, b = inv["default"], inv["batch_invariant"]
        print(f"batch invariance (--batch-invariant) beside the default fast path: one-sequence decode "
              f"{1 / b['decode_s']:.2f} vs {1 / d['decode_s']:.2f} tok/s ({inv['cost']['decode_s']:+.0%} time), a step "
              f"of {inv['batch']} sequences {b['batch_step_s'] * 1e3:.1f} vs {d['batch_step_s'] * 1e3:.1f} ms "
              f"({inv['cost']['batch_step_s']:+.0%}), a {inv['prompt']}-token prefill "
              f"{inv['prompt'] / b['prefill_s']:.0f} vs {inv['prompt'] / d['prefill_s']:.0f} tok/s "
              f"({inv['cost']['prefill_s']:+.0%} time)")
    if args.json:
        from deltafin.store.manifest import write_json_atomic

        write_json_atomic(args.json, r)
    return r
