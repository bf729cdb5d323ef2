"""Discrete-event model of decode and prefill over a drive set (no bytes move).

Per token and layer: route, look the experts up in a byte-bounded LRU, schedule the misses over
the drives (``deltafin.io.schedule``) per the placement, and book every read on its drive's
``DriveTimeline`` (the emulator's timing model). The layer waits for its slowest read; its math
takes ``math_s`` and, with ``overlap``, runs while the reads are in flight (layer time is the larger
of the two) instead of after them.

Prefill is expert-major: each layer reads every expert the prompt touches once, then computes.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from deltafin.io.emulator import DriveModel, DriveTimeline
from deltafin.io.schedule import LAYOUTS, layer_requests, schedule_layer
from deltafin.sim.cache import ByteLRU
from deltafin.sim.model import MoEShape
from deltafin.sim.routing import make_router, record_trace
from deltafin.store.placement import POLICIES, place


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated run. ``policy`` places expert files; ``layout`` reads them whole ("placed")
    or striped over all drives ("stripe" by rate, "raid0" equally)."""

    shape: MoEShape
    drives: tuple[DriveModel, ...]
    name: str = ""
    policy: str = "bandwidth"
    layout: str = "placed"
    cache_bytes: int = 0
    skew: float = 0.0  # Zipf exponent of expert popularity; 0 = uniform routing
    group: int = 0  # > 0: experts come in groups of this size that tokens route to together
    affinity: float = 0.0  # with ``group``: chance that a pick is a whole group
    tokens: int = 16  # decoded tokens measured (after the cache warms up)
    prompt: int = 512  # prompt tokens for time to first token; 0 skips prefill
    math_s: float = 0.0  # math per layer per decoded token
    prefill_math_s: float = 0.0  # math per layer for the whole prompt
    overlap: bool = True
    spare_fraction: float = 0.0  # "replicas": free space per drive, as a fraction of its share
    trace_tokens: int = 256  # tokens of routing trace for "coactivation" / "replicas"
    seed: int = 0
    trace: tuple = field(default=(), compare=False)  # replayed instead of random routing when given

    def __post_init__(self) -> None:
        if not self.drives:
            raise ValueError("simulation needs at least one drive")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown placement policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown read layout {self.layout!r}; known: {', '.join(LAYOUTS)}")
        if self.tokens < 1 or self.prompt < 0 or self.cache_bytes < 0 or self.math_s < 0:
            raise ValueError(f"bad simulation sizes: tokens={self.tokens}, prompt={self.prompt}, "
                             f"cache_bytes={self.cache_bytes}, math_s={self.math_s}")

    @property
    def summed_gbps(self) -> float:
        return sum(d.gbps for d in self.drives)


class _Drives:
    """The drive set in simulated time: timelines plus what the scheduler needs."""

    def __init__(self, models: tuple[DriveModel, ...], seed: int):
        self.timelines = [DriveTimeline(m, seed + 7919 * i) for i, m in enumerate(models)]
        self.rates = [m.gbps for m in models]
        self.latency = [m.lat_us * 1e-6 for m in models]

    def read_layer(self, t: float, experts: list[int], sizes: list[int], locations, layout: str):
        """Schedule and book one layer's reads at time ``t``; return (done time, ideal seconds)."""
        reqs = layer_requests(experts, sizes, locations, layout, self.rates)
        queued = [tl.backlog_bytes(t) for tl in self.timelines]
        sched = schedule_layer(reqs, self.rates, queued, self.latency)
        done = t
        for d, queue in enumerate(sched.queues):
            if queue:
                done = max(done, self.timelines[d].reserve_batch(t, [r.nbytes for r in queue]))
        return done, sched.ideal_s


def _placement(cfg: SimConfig):
    shape = cfg.shape
    sizes = {layer: [shape.expert_bytes] * shape.experts for layer in range(shape.layers)}
    specs = [d.to_drive_spec() for d in cfg.drives]
    if cfg.policy == "bandwidth":
        row = place({0: sizes[0]}, specs)[0]  # layers of one shape place alike: place one, share it
        return {layer: row for layer in sizes}
    if cfg.policy == "roundrobin":
        return place(sizes, specs, cfg.policy)
    recorder = make_router(shape, cfg.skew, cfg.seed + 101, None, cfg.group, cfg.affinity, cfg.seed)
    trace = list(cfg.trace) or record_trace(recorder, shape, cfg.trace_tokens)
    capacity = None
    if cfg.policy == "replicas":
        share = shape.total_bytes / cfg.summed_gbps
        capacity = [int(d.gbps * share * (1 + cfg.spare_fraction)) + shape.expert_bytes for d in cfg.drives]
    return place(sizes, specs, cfg.policy, trace=trace, capacity=capacity)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def simulate_decode(cfg: SimConfig, placement=None) -> dict:
    """Decode ``cfg.tokens`` tokens after warming the cache; return tok/s and per-layer figures."""
    shape = cfg.shape
    placement = placement if placement is not None else _placement(cfg)
    router = make_router(shape, cfg.skew, cfg.seed, cfg.trace or None, cfg.group, cfg.affinity, cfg.seed)
    drives = _Drives(cfg.drives, cfg.seed)
    cache = ByteLRU(cfg.cache_bytes)
    sizes = [shape.expert_bytes] * shape.experts
    warmup = math.ceil(cfg.cache_bytes / shape.bytes_per_token) + (1 if cfg.cache_bytes else 0)
    t = t0 = 0.0
    spans, ideals = [], []
    read_bytes = hits = lookups = 0
    for tok in range(warmup + cfg.tokens):
        measuring = tok >= warmup
        if tok == warmup:
            t0 = t
        for layer in range(shape.layers):
            experts = router.route(tok, layer)
            misses = [e for e in experts if not cache.hit((layer, e))]
            done, ideal = (drives.read_layer(t, misses, sizes, placement[layer], cfg.layout) if misses else (t, 0.0))
            for e in misses:
                cache.insert((layer, e), shape.expert_bytes)
            read_s = done - t
            t += max(read_s, cfg.math_s) if cfg.overlap else read_s + cfg.math_s
            if measuring:
                spans.append(read_s)
                ideals.append(ideal)
                read_bytes += len(misses) * shape.expert_bytes
                hits += len(experts) - len(misses)
                lookups += len(experts)
    elapsed = t - t0
    return _decode_figures(cfg, elapsed, spans, ideals, read_bytes, hits, lookups)


def _decode_figures(cfg: SimConfig, elapsed: float, spans, ideals, read_bytes, hits, lookups) -> dict:
    summed = cfg.summed_gbps * 1e9
    per_token = read_bytes / cfg.tokens
    return {
        "tok_s": cfg.tokens / elapsed if elapsed > 0 else math.inf,
        "bytes_bound_tok_s": summed / per_token if per_token else math.inf,
        "no_cache_bound_tok_s": summed / cfg.shape.bytes_per_token,
        "aggregate_fraction": read_bytes / (elapsed * summed) if elapsed > 0 else 0.0,
        "read_fraction": read_bytes / (sum(spans) * summed) if sum(spans) > 0 else 1.0,
        "hit_rate": hits / lookups if lookups else 0.0,
        "read_gb_per_token": per_token / 1e9,
        "makespan_ms_p50": _pct(spans, 0.5) * 1e3,
        "makespan_ms_p90": _pct(spans, 0.9) * 1e3,
        "makespan_ms_p99": _pct(spans, 0.99) * 1e3,
        "ideal_ms_p50": _pct(ideals, 0.5) * 1e3,
        "makespan_ms_mean": statistics.fmean(spans) * 1e3 if spans else 0.0,
    }


def simulate_prefill(cfg: SimConfig, placement=None) -> dict:
    """Time to first token for a ``cfg.prompt``-token prompt, expert-major (cold cache beyond
    ``cfg.cache_bytes`` is not modelled: every touched expert is read once)."""
    shape = cfg.shape
    placement = placement if placement is not None else _placement(cfg)
    router = make_router(shape, cfg.skew, cfg.seed + 7, cfg.trace or None, cfg.group, cfg.affinity, cfg.seed)
    drives = _Drives(cfg.drives, cfg.seed + 1)
    sizes = [shape.expert_bytes] * shape.experts
    t = 0.0
    touched = 0
    for layer in range(shape.layers):
        experts = sorted({e for route in router.route_batch(cfg.prompt, layer) for e in route})
        touched += len(experts)
        done, _ideal = drives.read_layer(t, experts, sizes, placement[layer], cfg.layout)
        read_s = done - t
        t += max(read_s, cfg.prefill_math_s) if cfg.overlap else read_s + cfg.prefill_math_s
    token_major_bytes = cfg.prompt * shape.bytes_per_token
    return {
        "ttft_s": t,
        "prefill_read_gb": touched * shape.expert_bytes / 1e9,
        "prefill_touched_fraction": touched / (shape.layers * shape.experts),
        "token_major_read_gb": token_major_bytes / 1e9,
        "token_major_ttft_bound_s": token_major_bytes / (cfg.summed_gbps * 1e9),
    }


def simulate(cfg: SimConfig) -> dict:
    """Decode and (when ``cfg.prompt``) prefill: one record with the configuration and figures."""
    placement = _placement(cfg)
    out = {
        "name": cfg.name or f"{len(cfg.drives)} drives, {cfg.policy}/{cfg.layout}",
        "model": cfg.shape.name,
        "drives": len(cfg.drives),
        "drive_spec": ";".join(d.spec() for d in cfg.drives),
        "summed_gbps": cfg.summed_gbps,
        "policy": cfg.policy,
        "layout": cfg.layout,
        "cache_gb": cfg.cache_bytes / 1e9,
        "skew": cfg.skew,
        "tokens": cfg.tokens,
        "prompt": cfg.prompt,
    }
    out.update(simulate_decode(cfg, placement))
    if cfg.prompt:
        out.update(simulate_prefill(cfg, placement))
    return out
