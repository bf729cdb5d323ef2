"""``deltafin bench classify``: inputs per hour for single-token classification, beside the read floor.

Synthetic model with Kimi K3's expert size, cold cache, seeded routing of every input token (k experts
per layer). Inputs are classified B at a time, each batch in one prefill pass: per layer, the union of
the batch's experts is fetched once through the engine's streaming source (expert-major). Floor = for
every batch, one pass over that union at the raw direct read rate measured in the same run. I/O-only mode
skips the expert math (and says so); full mode runs every expert on all of its tokens.
"""

from __future__ import annotations

import random
import time

import torch

from deltafin.bench.decode import situ_glu_expert
from deltafin.bench.synthetic import expert_major_layer, synthetic_run

K3_MOE_LAYERS, K3_EXPERTS, K3_K = 92, 896, 16  # Kimi K3: 82,432 expert files


def _routes(layers: list[int], experts: int, k: int, tokens: int, rng: random.Random) -> dict[int, list[list[int]]]:
    """Per layer, the k experts of every token of one input."""
    return {L: [rng.sample(range(experts), k) for _ in range(tokens)] for L in layers}


def k3_projection(batch: int, tokens: int, ratio: float, gbps: float = 25.0, nbytes: int = 17_551_360) -> float:
    """Inputs/hour on Kimi K3 over ``gbps`` of drives, uniform routing, at the ratio measured here."""
    union = K3_EXPERTS * (1 - (1 - K3_K / K3_EXPERTS) ** (batch * tokens))  # expected experts touched per layer
    floor_s = K3_MOE_LAYERS * union * nbytes / (gbps * 1e9)
    return batch / (floor_s * ratio) * 3600


def run(args) -> dict:
    if min(args.inputs, args.tokens, args.batch) < 1:
        from deltafin.errors import UsageError

        raise UsageError("--inputs, --tokens and --batch must be >= 1")

    from deltafin import kernels

    with synthetic_run(args, "classify") as run_, kernels.math(args.exact, args.device):
        pm, nbytes = run_.pm, run_.nbytes
        rng = random.Random(args.seed)
        inputs = [_routes(pm.moe_layers, pm.num_experts, args.k, args.tokens, rng) for _ in range(args.inputs)]
        source = run_.source(args.threads, args.device)
        x = torch.randn(args.batch * args.tokens, run_.latent, device=args.device)
        unique = alone = 0
        math_s = 0.0
        t0 = time.perf_counter()
        for b in range(0, args.inputs, args.batch):
            batch = inputs[b : b + args.batch]
            for L in pm.moe_layers:
                toks = [tok for r in batch for tok in r[L]]  # [B*T] routes of the batch's tokens
                alone += sum(len({e for tok in r[L] for e in tok}) for r in batch) * nbytes
                n, m = expert_major_layer(source, L, toks, x, args.io_only, situ_glu_expert)
                unique += n * nbytes
                math_s += m
        if args.device == "cuda":
            torch.cuda.synchronize()
        took = time.perf_counter() - t0
        st = source.stats
        source.close()
        raw = run_.remeasure()
    floor = unique / (raw * 1e9)
    ratio = took / floor
    rec = {
        "bench": "classify", "mode": "io-only" if args.io_only else "full", "device": args.device,
        "inputs": args.inputs, "tokens_per_input": args.tokens, "batch": args.batch, "moe_layers": args.layers,
        "experts": args.experts, "k": args.k, "bytes_read": st.bytes_read, "unique_bytes": unique,
        "bytes_one_at_a_time": alone, "seconds": took, "floor_s": floor, "ratio": ratio,
        "inputs_per_hour": args.inputs / took * 3600, "floor_inputs_per_hour": args.inputs / floor * 3600,
        "raw_GBps": raw, "raw_GBps_before_after": run_.probes, "math_s": math_s, "direct_io": source.direct,
        "k3_projected_inputs_per_hour_25GBps": k3_projection(args.batch, args.tokens, ratio),
    }
    print(f"classify ({rec['mode']}{', expert math skipped' if args.io_only else ''}, {args.device}): "
          f"{args.inputs} inputs x {args.tokens} tokens, {args.batch} per pass: {rec['inputs_per_hour']:,.0f} "
          f"inputs/hour vs read floor {rec['floor_inputs_per_hour']:,.0f} (one pass over each batch's expert union "
          f"{unique / 1e9:.2f} GB at raw direct {raw:.2f} GB/s): time {took:.2f} s / floor {floor:.2f} s = "
          f"{ratio:.2f}x; batching read {unique / max(alone, 1):.2f}x the bytes of one input at a time"
          + ("" if args.io_only else f"; expert math {math_s:.2f} s")
          + f". Projected Kimi K3 on ~25 GB/s of drives: {rec['k3_projected_inputs_per_hour_25GBps']:,.0f} inputs/hour")
    if args.json:
        from deltafin.store.manifest import write_json_atomic

        write_json_atomic(args.json, rec)
    return rec
