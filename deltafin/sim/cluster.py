"""A cluster of machines running one model expert-parallel (``runtime/distributed.py``), in simulated time.

Each machine holds the trunk (replicated), owns an equal share of every layer's experts (the ownership
``store/ranks.py`` plans for equal machines), caches as many of its owned experts as its memory holds after
the trunk, and reads the rest from its own drives (the single-machine simulator's drive timelines and layer
scheduler). Per decoded token and MoE layer:

    layer time = max over machines (trunk pass + max(its reads, its expert math)) + all-reduce

where the trunk pass and the expert math are memory passes (bytes / memory bandwidth: decode reads every
trunk weight once per token), and the all-reduce moves the [T, k, latent] slot buffer (module
``runtime/distributed``) over a ring: ``2 (N-1) hop latency + 2 (N-1)/N bytes / bandwidth``.

Routing is uniform (Kimi K3's router is trained for flat expert use), so a machine's cache in steady state
holds a uniformly random subset of its owned experts; the decode figures start from that state. Time to first
token is the first prompt after start: cold caches, every touched expert read once (expert-major), prompt
math not modelled beyond the trunk's memory pass.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from deltafin.io.emulator import DriveModel
from deltafin.sim.engine import _Drives
from deltafin.sim.model import KIMI_K3, MoEShape, report_drives
from deltafin.sim.routing import make_router
from deltafin.store.placement import place

GB = 1e9
K3_TRUNK_GB = 57.4  # int8 trunk of Kimi K3 (README: 'deltafin pack --plan' on its shipped config)
K3_LATENT = 3584  # routed experts work in the latent; the slot buffer is [T, k, latent]


@dataclass(frozen=True, slots=True)
class Machine:
    memory_gb: float = 128.0
    drives: tuple[DriveModel, ...] = report_drives(4)
    mem_gbps: float = 200.0  # memory bandwidth for the trunk and expert passes (assumed)
    reserve_gb: float = 8.0  # OS, activations, KV state, read buffers (assumed)


@dataclass(frozen=True, slots=True)
class Network:
    gbit: float  # link bandwidth per machine, Gb/s
    hop_us: float = 25.0  # latency per ring step of a collective (TCP over Ethernet, assumed)

    def allreduce_s(self, nbytes: float, n: int) -> float:
        """The faster of a ring (bandwidth-optimal) and recursive doubling (latency-optimal), as collective
        libraries choose by message size."""
        if n <= 1:
            return 0.0
        hop, bw = self.hop_us * 1e-6, self.gbit / 8 * GB
        ring = 2 * (n - 1) * hop + 2 * (n - 1) / n * nbytes / bw
        doubling = math.ceil(math.log2(n)) * (hop + nbytes / bw)
        return min(ring, doubling)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    machines: int
    net: Network
    machine: Machine = Machine()
    shape: MoEShape = KIMI_K3
    trunk_gb: float = K3_TRUNK_GB
    latent: int = K3_LATENT
    act_bytes: int = 2  # bf16 slot buffers
    tokens: int = 8
    prompt: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.machines < 1 or self.tokens < 1 or self.prompt < 0:
            raise ValueError(f"cluster: need machines >= 1, tokens >= 1, prompt >= 0; got {self}")
        if self.trunk_gb + self.machine.reserve_gb >= self.machine.memory_gb:
            raise ValueError(f"cluster: a {self.machine.memory_gb:g} GB machine cannot hold the {self.trunk_gb:g} GB "
                             f"trunk and {self.machine.reserve_gb:g} GB of headroom")

    @property
    def cache_bytes(self) -> float:
        return (self.machine.memory_gb - self.trunk_gb - self.machine.reserve_gb) * GB


class _Rank:
    """One machine: its owned experts per layer (the same ids every layer), cached subset, drives."""

    def __init__(self, cfg: ClusterConfig, r: int, owned: list[int], rng: random.Random):
        shape = cfg.shape
        self.owned = set(owned)
        fit = int(cfg.cache_bytes // shape.expert_bytes)  # experts of all layers its memory holds
        keys = [(L, e) for L in range(shape.layers) for e in owned]
        self.cached = set(keys) if fit >= len(keys) else set(rng.sample(keys, fit))
        self.drives = _Drives(cfg.machine.drives, cfg.seed + 104_729 * r)
        specs = [d.to_drive_spec() for d in cfg.machine.drives]
        row = place({0: [shape.expert_bytes] * len(owned)}, specs)[0]
        self.location = {e: row[i] for i, e in enumerate(owned)}  # owned expert -> [drive]
        self.sizes = {e: shape.expert_bytes for e in owned}

    def read(self, t: float, layer: int, experts: list[int]) -> float:
        """Seconds from ``t`` until this machine's reads of ``experts`` (owned misses) land."""
        if not experts:
            return 0.0
        done, _ideal = self.drives.read_layer(t, experts, self.sizes, self.location, "placed")
        return done - t


def _ranks(cfg: ClusterConfig) -> list[_Rank]:
    rng = random.Random(cfg.seed)
    n, E = cfg.machines, cfg.shape.experts
    return [_Rank(cfg, r, [e for e in range(E) if e % n == r], rng) for r in range(n)]


def simulate_cluster(cfg: ClusterConfig) -> dict:
    """Decode tok/s (steady-state caches) and cold time to first token, with the bounds beside them."""
    shape, m = cfg.shape, cfg.machine
    ranks = _ranks(cfg)
    trunk_layer_s = cfg.trunk_gb / m.mem_gbps / shape.layers  # GB / (GB/s)
    net_layer_s = cfg.net.allreduce_s(shape.top_k * cfg.latent * cfg.act_bytes, cfg.machines)
    router = make_router(shape, 0.0, cfg.seed)
    t, read_bytes, slowest_read = 0.0, 0, 0.0
    for tok in range(cfg.tokens):
        for layer in range(shape.layers):
            experts = router.route(tok, layer)
            span = 0.0
            for rk in ranks:
                mine = [e for e in experts if e in rk.owned]
                miss = [e for e in mine if (layer, e) not in rk.cached]
                read_s = rk.read(t, layer, miss)
                math_s = len(mine) * shape.expert_bytes / (m.mem_gbps * GB)
                span = max(span, trunk_layer_s + max(read_s, math_s))
                slowest_read = max(slowest_read, read_s)
                read_bytes += len(miss) * shape.expert_bytes
            t += span + net_layer_s
    out = _decode_bounds(cfg, ranks, trunk_layer_s, net_layer_s)
    out.update(tok_s=cfg.tokens / t, read_gb_per_token=read_bytes / cfg.tokens / GB,
               net_ms_per_token=net_layer_s * shape.layers * 1e3)
    out["of_bound"] = out["tok_s"] / out["bound_tok_s"]
    if cfg.prompt:
        out.update(_prefill(cfg, trunk_layer_s))
    return out


def _decode_bounds(cfg: ClusterConfig, ranks: list[_Rank], trunk_layer_s: float, net_layer_s: float) -> dict:
    """Per-token floors: every drive of the cluster reading at its rate all the time (for the expected miss
    bytes), the memory pass of one machine (trunk + its share of the routed experts), and the network."""
    shape, m = cfg.shape, cfg.machine
    total = shape.layers * shape.experts
    cached = sum(len(rk.cached) for rk in ranks) / total
    miss_bytes = shape.bytes_per_token * (1 - cached)
    summed = sum(d.gbps for d in m.drives) * GB * cfg.machines
    read_s = miss_bytes / summed
    mem_s = trunk_layer_s * shape.layers + shape.bytes_per_token / cfg.machines / (m.mem_gbps * GB)
    net_s = net_layer_s * shape.layers
    floor = max(read_s, mem_s) + net_s
    return {"machines": cfg.machines, "net_gbit": cfg.net.gbit, "cached_fraction": cached,
            "read_bound_tok_s": 1 / read_s if read_s else math.inf, "memory_bound_tok_s": 1 / mem_s,
            "bound_tok_s": 1 / floor}


def _prefill(cfg: ClusterConfig, trunk_layer_s: float) -> dict:
    """Cold time to first token: per layer every machine reads the touched experts it owns, then the
    [prompt, k, latent] slot buffers are summed over the network."""
    shape = cfg.shape
    ranks = _ranks(cfg)
    router = make_router(shape, 0.0, cfg.seed + 7)
    net_s = cfg.net.allreduce_s(cfg.prompt * shape.top_k * cfg.latent * cfg.act_bytes, cfg.machines)
    t, read_s_total = 0.0, 0.0
    for layer in range(shape.layers):
        touched = sorted({e for route in router.route_batch(cfg.prompt, layer) for e in route})
        span = max(rk.read(t, layer, [e for e in touched if e in rk.owned]) for rk in ranks)
        read_s_total += span
        t += trunk_layer_s + span + net_s
    return {"ttft_s": t, "ttft_read_s": read_s_total, "ttft_net_s": net_s * shape.layers}


def cluster_table(machines: tuple[int, ...] = (1, 2, 4, 8, 12), gbits: tuple[float, ...] = (10.0, 100.0),
                  machine: Machine = Machine(), hop_us: float = 25.0, tokens: int = 8, prompt: int = 512,
                  seed: int = 0, shape: MoEShape = KIMI_K3, on_done=None) -> list[dict]:
    """One record per (network, machine count); ``on_done(1)`` after each (progress)."""
    out = []
    for g in gbits:
        for n in machines:
            out.append(simulate_cluster(ClusterConfig(n, Network(g, hop_us), machine, shape, tokens=tokens,
                                                      prompt=prompt, seed=seed)))
            if on_done is not None:
                on_done(1)
    return out


def format_cluster(records: list[dict]) -> str:
    head = (f"{'machines':>8s} {'net Gb/s':>8s} {'cached':>6s} {'tok/s':>7s} {'bound':>7s} {'of bound':>8s} "
            f"{'read GB/tok':>11s} {'net ms/tok':>10s} {'TTFT s':>7s}")
    rows = [head]
    for r in records:
        ttft = f"{r['ttft_s']:7.1f}" if "ttft_s" in r else f"{'-':>7s}"
        rows.append(f"{r['machines']:8d} {r['net_gbit']:8g} {100 * r['cached_fraction']:5.0f}% {r['tok_s']:7.3f} "
                    f"{r['bound_tok_s']:7.3f} {100 * r['of_bound']:7.0f}% {r['read_gb_per_token']:11.2f} "
                    f"{r['net_ms_per_token']:10.1f} {ttft}")
    return "\n".join(rows)


def plot_cluster(records: list[dict], out_dir: str, plt) -> list[str]:
    """tok/s and time to first token against machine count, one line per network, bounds dashed."""
    import os

    paths = []
    for key, bound, ylabel, name in (("tok_s", "bound_tok_s", "decode tok/s", "cluster_decode.png"),
                                     ("ttft_s", None, "time to first token (s), cold", "cluster_ttft.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for g in sorted({r["net_gbit"] for r in records}):
            pts = [r for r in records if r["net_gbit"] == g and key in r]
            line = ax.plot([p["machines"] for p in pts], [p[key] for p in pts], marker="o", label=f"{g:g} Gb/s")
            if bound:
                ax.plot([p["machines"] for p in pts], [p[bound] for p in pts], "--", color=line[0].get_color(),
                        label=f"{g:g} Gb/s bound")
        ax.set_xlabel("machines (128 GB, four drives each)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{KIMI_K3.name} over a cluster")
        ax.legend()
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
