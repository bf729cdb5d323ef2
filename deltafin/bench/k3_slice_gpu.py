"""A Kimi K3 slice at the real widths, built in GPU memory: decode and prefill math per layer, extrapolated.

``python -m deltafin.bench.k3_slice_gpu --layers 8 --experts 64 --device cuda --json OUT``. The slice has the
real K3 widths and layer schedule (layer 0 a dense SiTU MLP; every 4th layer and the last MLA, the others
KDA; hidden 7168, 96 heads, latent MoE 7168 -> 3584 with 16 of ``--experts`` routed experts of 3072, two
shared experts), random weights: an int8 trunk as the packer writes it (routers in bf16) and MXFP4 experts
as released, every expert resident in one GPU slab (the cached case). Each layer is timed on its own with
device events; the 93-layer figure is layer 0 + 68 KDA MoE layers + 24 MLA MoE layers at the slice's
per-kind medians, plus the head. The plain torch path (``DELTAFIN_KERNELS=torch``) is timed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from deltafin import k3_tiny
from deltafin.quant import int8 as q8

K3_EXPERT_PASS_S = 82_432 * 17_547_264 / 25e9  # all of K3's routed experts read once from ~25 GB/s of drives
K3_LAYERS, K3_MLA = 93, 24  # real schedule: MLA at 4, 8, ..., 92 and 93 (1-based); layer 1 is KDA + dense
SLICE_TEXT = dict(
    hidden_size=7168, vocab_size=163840, intermediate_size=33792, num_attention_heads=96, num_key_value_heads=96,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    kda_heads=96, kda_head_dim=128, num_experts_per_token=16, moe_intermediate_size=3072,
    routed_expert_hidden_size=3584, num_shared_experts=2, attn_res_block_size=12, mla_every=4,
)


class _GpuRand(k3_tiny._Rand):
    """k3_tiny's random draws, made on the device (the real widths are billions of values)."""

    def __init__(self, seed: int, device: torch.device):
        self.g = torch.Generator(device).manual_seed(seed)
        self.device = device

    def normal(self, shape, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=self.g, device=self.device) * std + mean

    def uniform(self, shape, lo: float, hi: float) -> torch.Tensor:
        return torch.rand(shape, generator=self.g, device=self.device) * (hi - lo) + lo


def _record(name: str, t: torch.Tensor):
    """The packer's trunk rule: 2-D weights int8 (routers kept), everything else as stored."""
    from deltafin.quant.record import QTensor

    if t.dim() == 2 and min(t.shape) > 1 and not name.endswith("mlp.gate.weight") \
            and not name.endswith("block_sparse_moe.gate.weight"):
        q, s = q8.quantize(t)
        return QTensor("int8", tuple(t.shape), q, s)
    fmt = {torch.bfloat16: "bf16", torch.float32: "f32"}[t.dtype]
    return QTensor(fmt, tuple(t.shape), t.contiguous())


def build(layers: int, experts: int, device: torch.device, seed: int = 0, host: bool = False):
    """(config, trunk records by packed name) of the slice, drawn on ``device``; ``host``: each record moved to
    host memory as it is made (the same values: a trunk that the GPU need not hold whole)."""
    cfg = k3_tiny.tiny_config(**SLICE_TEXT, num_hidden_layers=layers, num_experts=experts)
    tc = cfg["text_config"]
    r, d = _GpuRand(seed, device), tc["hidden_size"]
    kda_layers = set(tc["linear_attn_config"]["kda_layers"])
    w = {}
    for L in range(layers):
        t = k3_tiny._common(r, d)
        t |= {f"self_attn.{k}": x for k, x in (k3_tiny._kda(r, tc) if L + 1 in kda_layers
                                                else k3_tiny._mla(r, tc)).items()}
        if L < tc["first_k_dense_replace"]:
            t |= {f"mlp.{k}": x for k, x in k3_tiny._glu(r, d, tc["intermediate_size"]).items()}
        else:
            lat, E = tc["routed_expert_hidden_size"], tc["num_experts"]
            moe = {"gate.weight": r.linear(E, d, 2.0), "gate.e_score_correction_bias": r.normal((E,), 0.05),
                   "routed_expert_down_proj.weight": r.linear(lat, d, 2.0), "routed_expert_norm.weight": r.norm(lat),
                   "routed_expert_up_proj.weight": r.linear(d, lat)}
            moe |= {f"shared_experts.{n}": x for n, x in
                    k3_tiny._glu(r, d, tc["moe_intermediate_size"] * tc["num_shared_experts"]).items()}
            t |= {f"block_sparse_moe.{k}": x for k, x in moe.items()}
        for k, x in t.items():
            w[f"model.layers.{L}.{k}"] = _record(f"model.layers.{L}.{k}", x)
            if host:
                w[f"model.layers.{L}.{k}"] = w[f"model.layers.{L}.{k}"].to("cpu")
        del t
        torch.cuda.empty_cache() if device.type == "cuda" else None
    top = {"model.embed_tokens.weight": r.normal((tc["vocab_size"], d), 1.0).to(torch.bfloat16),
           "lm_head.weight": r.linear(tc["vocab_size"], d, 4.0), "model.norm.weight": r.norm(d),
           "model.output_attn_res_norm.weight": r.norm(d),
           "model.output_attn_res_proj.weight": r.normal((1, d), 0.1).to(torch.bfloat16)}
    w |= {k: _record(k, x).to("cpu") if host else _record(k, x) for k, x in top.items()}
    return tc, w


class SlabExperts:
    """Every routed expert of the slice resident in one slab (random MXFP4 bytes, scales near 2^0)."""

    def __init__(self, moe_layers: list[int], experts: int, inter: int, lat: int, device: torch.device):
        from deltafin.kernels.triton_moe import ExpertSlab
        from deltafin.quant.record import QTensor

        def rec(o, i):
            return QTensor("mxfp4", (o, i), torch.empty(o, i // 2, dtype=torch.uint8),
                           torch.empty(o, i // 32, dtype=torch.uint8))
        ex = {"gate": rec(inter, lat), "up": rec(inter, lat), "down": rec(lat, inter)}
        self.slab = ExpertSlab(len(moe_layers) * experts, ex, device)
        for r in ExpertSlab.ROLES:
            self.slab.data[r].random_(0, 256)
            self.slab.scale[r].random_(118, 131)
        self.slot = {(L, e): i * experts + e for i, L in enumerate(moe_layers) for e in range(experts)}
        self.nbytes = sum(t.nbytes for t in ex.values())
        self.views: dict = {}
        self.experts = experts
        self.resident = True  # False: the decode runner fetches every layer on the host, as a streaming cache does
        self._tables: dict = {}

    def resident_slots(self, layer: int):
        if not self.resident:
            return None
        if layer not in self._tables:
            self._tables[layer] = torch.tensor([self.slot[(layer, e)] for e in range(self.experts)],
                                               dtype=torch.int32, device=self.slab.data["gate"].device)
        return self._tables[layer]

    def served_resident(self, layer: int, n: int) -> None:
        pass

    def fetch(self, layer: int, ids):
        for e in ids:  # views made once and kept, as the engine's expert cache keeps them
            key = (layer, e)
            if key not in self.views:
                self.views[key] = self.slab.views(self.slot[key])
            yield e, self.views[key]


class _HostEvent:
    """torch.cuda.Event's timing interface on the host clock (the CPU smoke run)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: _HostEvent) -> float:
        return (other.t - self.t) * 1e3


def _layer_times(model, ids: torch.Tensor, state, experts) -> tuple[list[float], float]:
    """Seconds per layer (attention + MLP) and for embed + head, from device events around each."""
    ev = [torch.cuda.Event(enable_timing=True) if ids.is_cuda else _HostEvent() for _ in range(model.num_layers + 2)]
    ev[0].record()
    x = model.embed(ids)
    for i in range(model.num_layers):
        x = model.attn_part(i, x, state)
        x = model.mlp_part(i, x, experts)
        ev[i + 1].record()
    model.head(x)
    ev[-1].record()
    state.pos += ids.numel()
    if ids.is_cuda:
        torch.cuda.synchronize()
    per = [ev[i].elapsed_time(ev[i + 1]) * 1e-3 for i in range(model.num_layers)]
    return per, ev[-2].elapsed_time(ev[-1]) * 1e-3


def _project(tc: dict, per_layer: list[list[float]], head: list[float]) -> dict:
    """Medians per layer kind -> the 93-layer total."""
    mla = set(tc["linear_attn_config"]["full_attn_layers"])
    kinds = {"dense": [0], "kda_moe": [i for i in range(1, len(per_layer[0])) if i + 1 not in mla],
             "mla_moe": [i for i in range(1, len(per_layer[0])) if i + 1 in mla]}
    med = {k: statistics.median(s[i] for s in per_layer for i in v) if v else None for k, v in kinds.items()}
    h = statistics.median(head)
    total = med["dense"] + (K3_LAYERS - 1 - K3_MLA) * med["kda_moe"] + K3_MLA * (med["mla_moe"] or med["kda_moe"]) + h
    return {"per_kind_s": med, "head_s": h, "k3_93_layers_s": total}


def context_state(model, context: int, extra: int):
    """A sequence state ``context`` tokens deep, as a long prompt would leave it: every MLA layer's latent cache
    holds ``context`` rows (random, of a real latent's scale) and the KDA states are filled. Decode time depends
    on how many rows it attends over, not on what they hold, so no prefill is run to get there."""
    from deltafin.models.layers import GrowingCache

    st = model.new_state(context + extra)
    g = torch.Generator(device=model.device).manual_seed(3)
    for layer in st.layers:
        if isinstance(layer, GrowingCache):
            for t0 in range(0, context, 16384):
                n = min(16384, context - t0)
                layer.write(t0, torch.randn((n, *layer.row), generator=g, device=model.device).to(layer.buf.dtype))
        elif layer is not None and hasattr(layer, "S"):
            layer.S.normal_(0.0, 0.02, generator=g)
    st.pos = context
    return st


def run_decode(model, tc, experts, tokens: int, warm: int = 3, context: int = 0) -> dict:
    st = context_state(model, context, tokens + warm + 8) if context else model.new_state(tokens + warm + 8)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, tc["vocab_size"], (tokens + warm,), generator=g).to(model.device)
    per, head = [], []
    for i in range(tokens + warm):
        p, h = _layer_times(model, ids[i:i + 1], st, experts)
        if i >= warm:
            per.append(p)
            head.append(h)
    return _project(tc, per, head) | {"tokens": tokens}


GRAPH_MAX_LEN = 4096  # the engine's default context: graph MLA decode attends over the whole static buffer


def run_decode_graphs(model, tc, experts, tokens: int, warm: int = 3, max_len: int = GRAPH_MAX_LEN,
                      context: int = 0) -> dict:
    """Decode steps replayed from CUDA graphs (``runtime/cuda_graphs.py``): the first step runs eagerly,
    the second records, the rest replay. Device events after each routing step split a step into
    intervals of one MoE layer each (its attention and router, then the host fetch of its experts; the
    routed experts of the layer before open it), host wall time around the whole step besides."""
    from deltafin.runtime.cuda_graphs import DecodeGraphs

    runner = DecodeGraphs(model, experts)
    max_len = max(max_len, context + tokens + warm + 8)
    st = context_state(model, context, max_len - context) if context else model.new_state(max_len)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, tc["vocab_size"], (tokens + warm,), generator=g).to(model.device)
    intervals, walls = [], []
    for i in range(tokens + warm):
        marks: list = []

        def mark(marks=marks):
            marks.append(_event(ids))
            marks[-1].record()

        runner.mark = mark
        mark()
        t0 = time.perf_counter()
        runner.step(ids[i:i + 1], st)
        mark()
        if ids.is_cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        if i >= warm:
            walls.append(wall)
            intervals.append([a.elapsed_time(b) * 1e-3 for a, b in zip(marks, marks[1:], strict=False)])
    out = _project_graphs(tc, runner.moe, intervals, walls)
    from deltafin.models.layers import GrowingCache

    caches = [x.buf.nbytes for x in st.layers if isinstance(x, GrowingCache)]
    kdas = [x.S.nbytes + x.conv.nbytes for x in st.layers if hasattr(x, "S")]
    out["state_bytes"] = {"mla_layer": max(caches, default=0), "kda_layer": max(kdas, default=0),
                          "k3_93_layers": K3_MLA * max(caches, default=0) + (K3_LAYERS - K3_MLA) * max(kdas, default=0)}
    out |= {"tokens": tokens, "max_len": max_len, "context": context,
            "recorded": all(gr is not None for gr in runner.graphs)}
    if out["recorded"] and ids.is_cuda:  # the GPU's own time: every stage replayed back to back, no host step
        a, b = _event(ids), _event(ids)
        a.record()
        for _ in range(tokens):
            for gr in runner.graphs:
                gr.replay()
        b.record()
        torch.cuda.synchronize()
        out["gpu_only_step_s"] = a.elapsed_time(b) * 1e-3 / tokens
    return out


def _event(ids: torch.Tensor):
    return torch.cuda.Event(enable_timing=True) if ids.is_cuda else _HostEvent()


def _project_graphs(tc: dict, moe: list[int], intervals: list[list[float]], walls: list[float]) -> dict:
    """Interval 0: embed, the dense layer 0 and the first MoE layer's front; interval j: MoE layer j's
    attention and router plus the routed experts of the one before; the last also ends with routed experts
    and the head. 93 layers: the first interval, 67 KDA and 24 MLA middle intervals, the last."""
    mla = set(tc["linear_attn_config"]["full_attn_layers"])
    mid = {"kda_moe": [j for j in range(1, len(moe)) if moe[j] + 1 not in mla],
           "mla_moe": [j for j in range(1, len(moe)) if moe[j] + 1 in mla]}
    med = {k: statistics.median(s[j] for s in intervals for j in v) if v else None for k, v in mid.items()}
    first = statistics.median(s[0] for s in intervals)
    last = statistics.median(s[-1] for s in intervals)
    kda, mla_t = med["kda_moe"], med["mla_moe"] or med["kda_moe"]
    total = first + (K3_LAYERS - 2 - K3_MLA) * kda + K3_MLA * mla_t + last
    step = statistics.median(walls)
    return {"per_kind_s": {"first": first, **med, "last_and_head": last}, "k3_93_layers_s": total,
            "step_wall_s": step, "step_events_s": statistics.median(sum(s) for s in intervals),
            "per_moe_layer_s": statistics.median(s[j] for s in intervals for j in range(1, len(moe)))
            if len(moe) > 1 else None}


def run_prefill(model, tc, experts, tokens: int) -> dict:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, tc["vocab_size"], (tokens,), generator=g).to(model.device)
    # a first pass of the same length compiles the prefill-shaped kernels (block sizes follow the shape)
    _layer_times(model, ids, model.new_state(tokens + 8), experts)
    st = model.new_state(tokens + 8)
    t0 = time.perf_counter()
    per, head = _layer_times(model, ids, st, experts)
    wall = time.perf_counter() - t0
    out = _project(tc, [per], [head])
    out |= {"tokens": tokens, "wall_s": wall, "k3_tok_s": tokens / out["k3_93_layers_s"]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16, help="decode steps timed")
    ap.add_argument("--prefill", type=int, nargs="*", default=[4096], help="prompt lengths for prefill")
    ap.add_argument("--torch-steps", type=int, default=3, help="decode steps on the plain torch path")
    ap.add_argument("--context", type=int, nargs="*", default=[], help="also decode this many tokens deep")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny widths on the CPU (checks this script, not speed)")
    a = ap.parse_args(argv)
    run(a, "both")
    return 0


def from_cli(args, mode: str) -> dict:
    """``deltafin bench decode|prefill --synthetic k3-slice``: the slice with the command's options."""
    a = argparse.Namespace(layers=args.layers, experts=args.experts, json=args.json, smoke=False,
                           tokens=args.tokens if mode == "decode" else 0, torch_steps=3 if mode == "decode" else 0,
                           prefill=[args.prompt] if mode == "prefill" else [],
                           context=list(getattr(args, "context", None) or []) if mode == "decode" else [])
    if args.device != "cuda":
        from deltafin.errors import UsageError

        raise UsageError("--synthetic k3-slice times the CUDA kernels; run it with --device cuda")
    if getattr(args, "gpu_layers", None) is not None or getattr(args, "gpu_memory_gb", None) is not None:
        # the trunk split between the GPU and the CPU
        from deltafin.bench.k3_offload import run as run_offload

        return run_offload(a, mode, args.gpu_layers, args.gpu_memory_gb)
    return run(a, mode)


def k3_token_bytes(tc: dict, w: dict, expert_bytes: int) -> int:
    """What one 93-layer K3 decode token reads once with every expert cached: each slice layer kind's trunk
    records (medians, projected to K3's schedule: the dense layer 0, 68 KDA and 24 MLA MoE layers), the head and
    final norms, one embedding row, and 16 experts in each of the 92 MoE layers (the state comes on top)."""
    kda = set(tc["linear_attn_config"]["kda_layers"])
    per = {}
    for name, r in w.items():
        if name.startswith("model.layers."):
            L = int(name.split(".")[2])
            per[L] = per.get(L, 0) + r.nbytes
    kinds = {"kda": [b for L, b in per.items() if L > 0 and L + 1 in kda],
             "mla": [b for L, b in per.items() if L > 0 and L + 1 not in kda]}
    med = {k: statistics.median(v) if v else 0 for k, v in kinds.items()}
    mla = med["mla"] or med["kda"]
    emb = w["model.embed_tokens.weight"]
    top = sum(r.nbytes for n, r in w.items() if not n.startswith("model.layers.")) - emb.nbytes
    return int(per.get(0, 0) + (K3_LAYERS - 1 - K3_MLA) * med["kda"] + K3_MLA * mla + top
               + emb.nbytes // tc["vocab_size"] + (K3_LAYERS - 1) * tc["num_experts_per_token"] * expert_bytes)


def _copy_gbps(dev) -> float:
    """Device-to-device copy rate (bytes read + written per second), the decode's memory limit."""
    import triton.testing

    a = torch.empty(1 << 31, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    t = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=100, return_mode="median") * 1e-3
    return 2 * (1 << 31) / t / 1e9


def run(a, mode: str) -> dict:
    from deltafin.kernels import cuda as kc
    from deltafin.models import registry

    dev = torch.device("cpu" if a.smoke else "cuda")
    if a.smoke:
        SLICE_TEXT.update(k3_tiny.TINY_TEXT, attn_res_block_size=3, vocab_size=300)
        SLICE_TEXT.pop("num_hidden_layers"), SLICE_TEXT.pop("num_experts")
    t0 = time.time()
    tc, w = build(a.layers, a.experts, dev)
    experts = SlabExperts([L for L in range(1, a.layers)], a.experts, tc["moe_intermediate_size"],
                          tc["routed_expert_hidden_size"], dev)
    model = registry.build("kimi_k3", tc, w, dev, torch.bfloat16)
    res = {"layers": a.layers, "experts": a.experts, "build_s": time.time() - t0,
           "trunk_bytes": sum(r.nbytes for r in w.values()), "expert_bytes": experts.nbytes}
    if mode != "prefill":
        res["k3_token_bytes"] = k3_token_bytes(tc, w, experts.nbytes)
        res["copy_GBps"] = _copy_gbps(dev) if dev.type == "cuda" else None
        res["decode"] = run_decode(model, tc, experts, a.tokens)
        res["decode_graphs"] = run_decode_graphs(model, tc, experts, a.tokens)
        experts.resident = False  # the same step with each layer's host synchronisation, as while streaming
        res["decode_graphs_host"] = run_decode_graphs(model, tc, experts, a.tokens)
        experts.resident = True
        res["kernels"] = sorted(kc.USED)
        before = os.environ.get("DELTAFIN_KERNELS")
        os.environ["DELTAFIN_KERNELS"] = "torch"
        res["decode_torch"] = run_decode(model, tc, experts, a.torch_steps, warm=1)
        os.environ.pop("DELTAFIN_KERNELS")
        if before is not None:
            os.environ["DELTAFIN_KERNELS"] = before
        for n in getattr(a, "context", []):
            try:
                res[f"decode_ctx_{n}"] = run_decode_graphs(model, tc, experts, a.tokens, context=n)
            except torch.OutOfMemoryError as e:
                res[f"decode_ctx_{n}"] = {"error": str(e)[:300]}
            torch.cuda.empty_cache()
    for T in a.prefill:
        try:
            res[f"prefill_{T}"] = run_prefill(model, tc, experts, T)
        except torch.OutOfMemoryError as e:
            res[f"prefill_{T}"] = {"error": str(e)[:300]}
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)"
    print(f"k3-slice {a.layers} layers, {a.experts} experts (cached), bf16 on {name}")
    if "decode" in res:
        _print_decode(res)
        for n in getattr(a, "context", []):
            _print_context(n, res[f"decode_ctx_{n}"], res["decode_graphs"], res["layers"], res)
    for T in a.prefill:
        _print_prefill(T, res[f"prefill_{T}"])
    return res


def _print_decode(res: dict) -> None:
    d, dt, g = res["decode"], res["decode_torch"], res["decode_graphs"]
    print("decode per layer kind, eager (ms): "
          + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in d["per_kind_s"].items() if v) + f"; head {d['head_s'] * 1e3:.3f}")
    print("decode per MoE layer interval, CUDA graphs (ms): "
          + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in g["per_kind_s"].items() if v)
          + f"; step {g['step_wall_s'] * 1e3:.2f} ms wall for {res['layers']} layers (max_len {g['max_len']})"
          + (f"; GPU time alone {g['gpu_only_step_s'] * 1e3:.2f} ms" if "gpu_only_step_s" in g else "")
          + ("" if g["recorded"] else "; NOT recorded: the runner ran eagerly"))
    print(f"decode math per K3 token (93 layers): CUDA graphs {g['k3_93_layers_s'] * 1e3:.1f} ms vs target 25 ms "
          f"= {g['k3_93_layers_s'] / 0.025:.2f}x; eager {d['k3_93_layers_s'] * 1e3:.1f} ms "
          f"(graphs {d['k3_93_layers_s'] / g['k3_93_layers_s']:.1f}x faster); torch path "
          f"{dt['k3_93_layers_s'] * 1e3:.0f} ms; kernels {', '.join(res['kernels'])}")
    h = res.get("decode_graphs_host")
    if h:
        print(f"the same with a host synchronisation a MoE layer (experts looked up on the host, as while streaming): "
              f"{h['k3_93_layers_s'] * 1e3:.1f} ms a K3 token; step {h['step_wall_s'] * 1e3:.2f} ms wall")
    if res.get("copy_GBps"):
        bound = res["k3_token_bytes"] / (res["copy_GBps"] * 1e9)
        print(f"memory-read bound: {res['k3_token_bytes'] / 1e9:.1f} GB a K3 token (trunk and 16 experts a layer, "
              f"each read once) at the {res['copy_GBps']:.0f} GB/s device copy rate of this run = {bound * 1e3:.1f} ms; "
              f"the graphs' step {g['k3_93_layers_s'] / bound:.2f}x it")


def _print_context(n: int, c: dict, zero: dict, layers: int, res: dict | None = None) -> None:
    res = res or {}
    if "error" in c:
        print(f"decode {n} tokens deep: {c['error'][:120]}")
        return
    ms, ms0 = c["k3_93_layers_s"] * 1e3, zero["k3_93_layers_s"] * 1e3
    bound = ""
    if res.get("copy_GBps"):
        b = (res["k3_token_bytes"] + c["state_bytes"]["k3_93_layers"]) / (res["copy_GBps"] * 1e9) * 1e3
        bound = f"; memory-read bound with the state {b:.1f} ms ({ms / b:.2f}x)"
    print(f"decode {n} tokens deep (CUDA graphs, {c['max_len']}-row caches): {ms:.1f} ms per K3 token = "
          f"{1e3 / ms:.1f} tok/s of math, beside {ms0:.1f} ms = {1e3 / ms0:.1f} tok/s at the default context "
          f"({zero['max_len']} rows); the slice's step {c['step_wall_s'] * 1e3:.2f} ms wall for {layers} layers; "
          f"the sequence's state for 93 layers {c['state_bytes']['k3_93_layers'] / 1e9:.2f} GB ({K3_MLA} MLA "
          f"caches of {c['state_bytes']['mla_layer'] / 1e6:.0f} MB, {K3_LAYERS - K3_MLA} KDA states of "
          f"{c['state_bytes']['kda_layer'] / 1e6:.1f} MB)"
          + bound + ("" if c["recorded"] else "; NOT recorded: the runner ran eagerly"))


def _print_prefill(T: int, p: dict) -> None:
    if "error" in p:
        print(f"prefill {T}: {p['error'][:120]}")
    else:
        print(f"prefill {T} tokens: {p['k3_tok_s']:.0f} tok/s for the 93-layer model (target >= 2500 at 4096); "
              "per layer kind (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in p["per_kind_s"].items() if v)
              + f"; 200K-token prompt ~{200_000 / p['k3_tok_s'] / 60:.1f} min of math against a read floor of "
              f"{K3_EXPERT_PASS_S:.0f} s (such a prompt touches every expert: one pass over K3's 1.45 TB at ~25 GB/s)")


if __name__ == "__main__":
    raise SystemExit(main())
