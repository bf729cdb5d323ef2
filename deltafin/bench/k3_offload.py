"""``deltafin bench decode --synthetic k3-slice --device cuda --gpu-layers N`` (or ``--gpu-memory-gb GB``): the Kimi
K3 slice at the real widths (``k3_slice_gpu``) with its trunk split as the engine splits it (``runtime/offload``):
the last N layers and the head on the GPU in bf16, the first layers and the embeddings on the CPU's fast path.

Every routed expert is resident where its layer runs (the GPU slab, or host memory): the cached case, as the
all-GPU slice. Each layer of a decode step is timed on its own device (CPU layers on the host clock: their math is
synchronous; GPU layers with CUDA events), the hand-over of the carry on the host clock. The 93-layer K3 token is
projected from per-kind medians on each side with the same share of its layers on the GPU, and printed beside its
memory-read bound: each side's trunk bytes and 16 experts per MoE layer read once at the rates measured in the same
run (host memory, the GPU's memory). ``--gpu-layers`` 0 and the slice's layer count give the one-device figures of
the same build (the all-on-GPU one to set the split beside).
"""

from __future__ import annotations

import statistics
import time

import torch

from deltafin.bench import k3_slice_gpu as ks
from deltafin.quant.record import QTensor
from deltafin.runtime.offload import cuda_index

K3_SCHEDULE = [("dense" if j == 0 else "mla_moe" if (j + 1) % 4 == 0 or j == ks.K3_LAYERS - 1 else "kda_moe")
               for j in range(ks.K3_LAYERS)]  # layer 1 dense (KDA attention), MLA at 4, 8, ..., 92 and 93 (1-based)


class HostExperts:
    """Every routed expert of some layers in host memory (random MXFP4 bytes, scales near 2^0), as the engine's
    host cache holds the CPU layers' experts."""

    def __init__(self, layers: list[int], experts: int, inter: int, lat: int, seed: int = 3):
        g = torch.Generator().manual_seed(seed)
        self.shapes = {"gate": (inter, lat), "up": (inter, lat), "down": (lat, inter)}
        n = len(layers) * experts
        self.data = {r: torch.randint(0, 256, (n, o, i // 2), generator=g, dtype=torch.uint8)
                     for r, (o, i) in self.shapes.items()}
        self.scale = {r: torch.randint(118, 131, (n, o, i // 32), generator=g, dtype=torch.uint8)
                      for r, (o, i) in self.shapes.items()}
        self.slot = {(L, e): j * experts + e for j, L in enumerate(layers) for e in range(experts)}
        self.views: dict = {}

    def _get(self, key):
        if key not in self.views:
            s = self.slot[key]
            self.views[key] = {r: QTensor("mxfp4", sh, self.data[r][s], self.scale[r][s])
                               for r, sh in self.shapes.items()}
        return self.views[key]

    def fetch(self, layer: int, ids):
        for e in ids:
            yield e, self._get((layer, e))

    def fetch_groups(self, layer: int, ids):
        yield [(e, self._get((layer, e))) for e in ids]


class SideExperts:
    """Layers below ``first`` from ``low`` (host), the others from ``high`` (the GPU slab)."""

    def __init__(self, low, high, first: int):
        self.low, self.high, self.first = low, high, first

    def fetch(self, layer: int, ids):
        return (self.high if layer >= self.first else self.low).fetch(layer, ids)

    def fetch_groups(self, layer: int, ids):
        src = self.high if layer >= self.first else self.low
        if hasattr(src, "fetch_groups"):
            return src.fetch_groups(layer, ids)
        return ([item] for item in src.fetch(layer, ids))  # the slab on the CPU (the smoke run)

    @property
    def slab(self):
        return getattr(self.high, "slab", None)


def _kinds(tc: dict, layers: int) -> list[str]:
    mla = set(tc["linear_attn_config"]["full_attn_layers"])
    return ["dense" if i == 0 else "mla_moe" if i + 1 in mla else "kda_moe" for i in range(layers)]


def _plan(a, tc, w, expert_bytes: int, gpu_layers, cap_gb, gpu: torch.device):
    """The engine's placement rule over the slice: each layer's bytes are its trunk records and its resident
    experts (the slice caches every expert where its layer runs)."""
    from deltafin.runtime.engine import CUDA_HEADROOM
    from deltafin.runtime.offload_plan import TrunkSizes, plan_offload

    sizes = TrunkSizes.from_nbytes({n: r.nbytes for n, r in w.items()}, a.layers)
    trunk_only = sizes
    sizes = TrunkSizes(tuple(b + (a.experts * expert_bytes if i else 0) for i, b in enumerate(sizes.layers)),
                       sizes.embed, sizes.head)
    if gpu.type == "cuda":
        torch.cuda.empty_cache()  # the build's draws
        free, _ = torch.cuda.mem_get_info(gpu)
        headroom = CUDA_HEADROOM
    else:  # the CPU smoke run: no GPU memory to fit
        free, headroom = 1 << 60, 0
    budget = free if cap_gb is None else min(int(cap_gb * 1e9), free)
    return plan_offload(sizes, budget, headroom, gpu_layers, cap_gb, str(gpu)), trunk_only


def _model(tc, w, plan, gpu: torch.device):
    from deltafin.models import registry
    from deltafin.runtime import offload
    from deltafin.runtime.engine import widen_small

    cpu = torch.device("cpu")
    if plan.gpu_layers == 0:
        return registry.build("kimi_k3", tc, widen_small(w), cpu, torch.float32)
    if plan.all_gpu:
        model = registry.build("kimi_k3", tc, w, gpu, torch.bfloat16)
    else:
        model = offload.build_split("kimi_k3", tc, w, plan, gpu, torch.float32, torch.bfloat16, widen_small)
    model.stack_decode_projections()  # as the engine does for bf16 on CUDA
    return model


def _step(model, ids: torch.Tensor, st, experts, first: int) -> tuple[list[float], float, float]:
    """One decode step: (seconds per layer, hand-over seconds, head seconds), each on its side's clock."""
    from deltafin.runtime.offload import SplitModel, hand_over

    L, gpu = model.num_layers, ids.device
    split = isinstance(model, SplitModel)
    ev = [ks._event(ids) for _ in range(2 * (L - first) + 2)]
    per, handover = [0.0] * L, 0.0
    x = model.embed(ids)
    for i in range(L):
        m = model.part(i) if split else model
        if i < first:
            t0 = time.perf_counter()
            x = m.mlp_part(i, m.attn_part(i, x, st), experts)  # host tensors: done when it returns
            per[i] = time.perf_counter() - t0
            continue
        if i == first and split:
            t0 = time.perf_counter()
            x = hand_over(x, model.high.device, model.high.dtype)
            torch.cuda.synchronize() if gpu.type == "cuda" else None
            handover = time.perf_counter() - t0
        j = 2 * (i - first)
        ev[j].record()
        x = m.mlp_part(i, m.attn_part(i, x, st), experts)
        ev[j + 1].record()
    ev[-2].record()
    t0 = time.perf_counter()
    model.head(x)
    ev[-1].record()
    if gpu.type == "cuda":
        torch.cuda.synchronize()
    st.pos += 1
    for i in range(first, L):
        per[i] = ev[2 * (i - first)].elapsed_time(ev[2 * (i - first) + 1]) * 1e-3
    head = ev[-2].elapsed_time(ev[-1]) * 1e-3 if first < L else time.perf_counter() - t0
    return per, handover, head


def _medians(kinds: list[str], first: int, steps: list[list[float]]) -> dict[tuple[str, str], float]:
    out = {}
    for side in ("cpu", "gpu"):
        for kind in ("dense", "kda_moe", "mla_moe"):
            xs = [s[i] for s in steps for i, k in enumerate(kinds) if k == kind and (i >= first) == (side == "gpu")]
            if xs:
                out[(side, kind)] = statistics.median(xs)
    return out


def _on(med: dict, side: str, kind: str):
    """A kind's median on a side, the side's other MoE kind where the slice has none of it there."""
    other = {"kda_moe": "mla_moe", "mla_moe": "kda_moe"}.get(kind)
    return med.get((side, kind), med.get((side, other)) if other else None)


def _project(med: dict, k3_gpu: int, head_s: float, handover_s: float) -> float | None:
    """Seconds of a 93-layer K3 token with its last ``k3_gpu`` layers on the GPU; None where the slice has no
    layer of a kind the projection needs on that side."""
    first, total = ks.K3_LAYERS - k3_gpu, head_s + handover_s
    for j, kind in enumerate(K3_SCHEDULE):
        t = _on(med, "gpu" if j >= first else "cpu", kind)
        if t is None:
            return None
        total += t
    return total


def _bytes_per_token(kinds, first, trunk, k: int, expert_bytes: int, k3_gpu: int) -> dict[str, float]:
    """Bytes a 93-layer K3 token reads on each side: each layer's trunk records (the slice's per-kind median)
    and its k routed experts, plus the head on its side."""
    by = {kind: statistics.median(b for b, kk in zip(trunk.layers, kinds, strict=True) if kk == kind)
          for kind in set(kinds)}
    out = {"cpu": 0.0, "gpu": 0.0}
    for j, kind in enumerate(K3_SCHEDULE):
        b = by.get(kind, by.get("kda_moe", 0)) + (k * expert_bytes if kind != "dense" else 0)
        out["gpu" if j >= ks.K3_LAYERS - k3_gpu else "cpu"] += b
    out["gpu" if k3_gpu else "cpu"] += trunk.head
    return out


def read_rates(gpu: torch.device) -> dict[str, float]:
    """GB/s of one pass over a large tensor (a sum), best of a few: host memory with torch's threads, the GPU's
    memory where there is one."""
    def best(fn, nbytes, sync):
        ts = []
        for _ in range(4):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        return nbytes / min(ts[1:]) / 1e9

    host = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    out = {"host_GBps": best(host.sum, host.numel() * 4, lambda: None)}
    del host
    if gpu.type == "cuda":
        dev = torch.ones(1 << 31, dtype=torch.bfloat16, device=gpu)  # 4 GiB
        out["gpu_GBps"] = best(dev.sum, dev.numel() * 2, torch.cuda.synchronize)
        del dev
        torch.cuda.empty_cache()
    else:
        out["gpu_GBps"] = out["host_GBps"]
    return out


def run(a, mode: str, gpu_layers: int | None, cap_gb: float | None) -> dict:
    """The split slice's decode (``a`` as ``k3_slice_gpu.from_cli`` makes it; ``a.smoke``: tiny widths, both
    sides on the CPU, checking this code, not speed)."""
    from deltafin import kernels
    from deltafin.errors import UsageError
    from deltafin.runtime.offload_plan import record_bytes
    from deltafin.store.manifest import write_json_atomic

    if mode != "decode":
        raise UsageError("--gpu-layers/--gpu-memory-gb with --synthetic k3-slice time decode steps; run 'deltafin "
                         "bench decode --synthetic k3-slice --device cuda --gpu-layers N'")
    gpu = torch.device("cpu" if a.smoke else "cuda")
    if a.smoke:
        ks.SLICE_TEXT.update(ks.k3_tiny.TINY_TEXT, attn_res_block_size=3, vocab_size=300)
        ks.SLICE_TEXT.pop("num_hidden_layers", None), ks.SLICE_TEXT.pop("num_experts", None)
    t0 = time.time()
    tc, w = ks.build(a.layers, a.experts, gpu, host=True)  # drawn on the GPU a layer at a time, kept on the host
    inter, lat = tc["moe_intermediate_size"], tc["routed_expert_hidden_size"]
    expert_bytes = sum(record_bytes("mxfp4", s) for s in ((inter, lat), (inter, lat), (lat, inter)))
    rates = read_rates(gpu)  # before anything is placed (and before a cap)
    plan, trunk = _plan(a, tc, w, expert_bytes, gpu_layers, cap_gb, gpu)
    if cap_gb is not None and gpu.type == "cuda":  # the allocator refuses to grow past the cap from here on
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info(gpu)
        torch.cuda.set_per_process_memory_fraction(min(cap_gb * 1e9 / total, 1.0), cuda_index(gpu))
        torch.cuda.reset_peak_memory_stats(gpu)
    moe = list(range(1, a.layers))
    first = plan.first_gpu
    low = HostExperts([L for L in moe if L < first], a.experts, inter, lat) if first > 1 else None
    high = ks.SlabExperts([L for L in moe if L >= first], a.experts, inter, lat, gpu) if plan.gpu_layers else None
    experts = SideExperts(low, high, first)
    model = _model(tc, w, plan, gpu)
    del w
    build_s = time.time() - t0
    kinds = _kinds(tc, a.layers)
    g = torch.Generator().manual_seed(1)
    warm = 3
    ids = torch.randint(0, tc["vocab_size"], (a.tokens + warm,), generator=g).to(gpu if plan.gpu_layers else "cpu")
    st = model.new_state(a.tokens + warm + 8)
    steps, handovers, heads, walls = [], [], [], []
    with kernels.math(False, "cpu"), torch.inference_mode():  # the engine's fast path on both sides
        for i in range(a.tokens + warm):
            t_step = time.perf_counter()
            per, ho, head = _step(model, ids[i:i + 1], st, experts, first)
            if i >= warm:
                steps.append(per), handovers.append(ho), heads.append(head)
                walls.append(time.perf_counter() - t_step)
    med = _medians(kinds, first, steps)
    k3_gpu = round(ks.K3_LAYERS * plan.gpu_layers / a.layers)
    handover = statistics.median(handovers) if plan.split else 0.0
    k3_s = _project(med, k3_gpu, statistics.median(heads), handover)
    k = tc["num_experts_per_token"]
    bpt = _bytes_per_token(kinds, first, trunk, k, expert_bytes, k3_gpu)
    bound_s = bpt["cpu"] / (rates["host_GBps"] * 1e9) + bpt["gpu"] / (rates["gpu_GBps"] * 1e9)
    res = {"bench": "decode", "synthetic": "k3-slice", "offload": plan.describe(), "layers": a.layers,
           "experts": a.experts, "gpu_layers": plan.gpu_layers, "first_gpu_layer": first, "k3_gpu_layers": k3_gpu,
           "gpu_bytes": plan.gpu_bytes, "cpu_bytes": plan.cpu_bytes, "build_s": build_s, "tokens": a.tokens,
           "slice_step_wall_s": statistics.median(walls), "per_kind_s": {f"{s}:{kd}": v for (s, kd), v in med.items()},
           "handover_s": handover, "head_s": statistics.median(heads), "k3_93_layers_s": k3_s,
           "k3_tok_s": 1 / k3_s if k3_s else None, "bytes_per_token": bpt, **rates,
           "memory_read_bound_s": bound_s, "over_bound": k3_s / bound_s if k3_s else None,
           "cap_gb": cap_gb, "peak_reserved_bytes": torch.cuda.max_memory_reserved(gpu) if gpu.type == "cuda" else None,
           "device": torch.cuda.get_device_name(gpu) if gpu.type == "cuda" else "cpu (smoke)"}
    if cap_gb is not None and gpu.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, cuda_index(gpu))
    if a.json:
        write_json_atomic(a.json, res)
    _print(res)
    return res


def _print(r: dict) -> None:
    kinds = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in r["per_kind_s"].items())
    print(f"k3-slice {r['layers']} layers, {r['experts']} experts (cached where their layer runs) on {r['device']}: "
          f"{r['offload']}")
    cap = "" if r["cap_gb"] is None else (f"; --gpu-memory-gb {r['cap_gb']}: peak reserved "
                                          f"{r['peak_reserved_bytes'] / 1e9:.2f} GB")
    print(f"decode per layer (ms, side:kind): {kinds}; hand-over {r['handover_s'] * 1e3:.3f} ms, head "
          f"{r['head_s'] * 1e3:.2f} ms; slice step {r['slice_step_wall_s'] * 1e3:.1f} ms wall{cap}")
    bound = (f"memory-read bound {r['memory_read_bound_s'] * 1e3:.1f} ms ({r['bytes_per_token']['cpu'] / 1e9:.1f} GB "
             f"at host {r['host_GBps']:.0f} GB/s + {r['bytes_per_token']['gpu'] / 1e9:.1f} GB at GPU "
             f"{r['gpu_GBps']:.0f} GB/s, measured)")
    if r["k3_93_layers_s"] is None:
        print(f"decode per K3 token (93 layers, {r['k3_gpu_layers']} on the GPU): not projected, the slice has no "
              f"MoE layer on one side (give --layers more, or --gpu-layers between 1 and layers - 2); {bound}")
        return
    print(f"decode per K3 token (93 layers, {r['k3_gpu_layers']} on the GPU): {r['k3_93_layers_s'] * 1e3:.1f} ms = "
          f"{r['k3_tok_s']:.2f} tok/s vs {bound} = {r['over_bound']:.2f}x; the all-on-GPU figure: --gpu-layers "
          f"{r['layers']}")
