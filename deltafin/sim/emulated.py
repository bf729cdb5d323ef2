"""Cross-check: the same small decode run through the simulator and through the emulated drives.

The emulated run moves real bytes (from memory) with every layer's reads in flight at once, as
the simulator assumes; the two tok/s figures should agree within about 10%.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from deltafin.io.direct import aligned_buffer
from deltafin.io.emulator import EmulatedDriveSet
from deltafin.io.schedule import layer_requests, schedule_layer
from deltafin.sim.cache import ByteLRU
from deltafin.sim.engine import SimConfig, _placement, simulate_decode
from deltafin.sim.routing import make_router


def _emulated_decode(cfg: SimConfig, placement, workers: int) -> float:
    """Seconds the emulated drives take to serve ``cfg.tokens`` tokens of reads (no warm-up)."""
    shape = cfg.shape
    payload = bytes(shape.expert_bytes)
    memory = {f"L{layer}/E{e}": payload for layer in range(shape.layers) for e in range(shape.experts)}
    drives = EmulatedDriveSet(cfg.drives, memory=memory, seed=cfg.seed)
    readers = drives.readers()
    rates = [d.gbps for d in cfg.drives]
    latency = [d.lat_us * 1e-6 for d in cfg.drives]
    router = make_router(shape, cfg.skew, cfg.seed, cfg.trace or None, cfg.group, cfg.affinity, cfg.seed)
    cache = ByteLRU(cfg.cache_bytes)
    sizes = [shape.expert_bytes] * shape.experts
    bufs = [aligned_buffer(shape.expert_bytes) for _ in range(workers)]
    zeros = bytes(len(bufs[0]))
    for b in bufs:  # fault the pages in now: a first touch inside a timed read costs milliseconds
        b[:] = zeros
    with ThreadPoolExecutor(workers) as pool:
        for f in [pool.submit(time.sleep, 0.01) for _ in range(workers)]:  # start every worker thread first
            f.result()
        t0 = time.monotonic()
        for tok in range(cfg.tokens):
            for layer in range(shape.layers):
                misses = [e for e in router.route(tok, layer) if not cache.hit((layer, e))]
                reqs = layer_requests(misses, sizes, placement[layer], cfg.layout, rates)
                sched = schedule_layer(reqs, rates, None, latency)
                # first read of every drive first, then every drive's second read, ...
                reads = [r for rank in range(max(map(len, sched.queues))) for q in sched.queues
                         if rank < len(q) for r in (q[rank],)]
                assert len(reads) <= workers, "raise workers: every read of a layer must be in flight at once"
                futs = [pool.submit(readers[r.drive].read_into, f"L{layer}/E{r.expert}", r.offset,
                                    bufs[i][: r.nbytes]) for i, r in enumerate(reads)]
                for f in futs:
                    f.result()
                for e in misses:
                    cache.insert((layer, e), shape.expert_bytes)
        return time.monotonic() - t0


def crosscheck(cfg: SimConfig, workers: int = 64) -> dict:
    """Run ``cfg`` (small: it really waits) in the simulator and on emulated drives.

    Returns both tok/s and their ratio (emulated / simulated). Use a shape and drive rates this
    machine can move in a second or two, e.g. 4 layers of 16 x 1 MiB experts on ``report4@0.02``.
    """
    if cfg.cache_bytes:
        raise ValueError("crosscheck runs without a cache warm-up; set cache_bytes=0")
    placement = _placement(cfg)
    sim = simulate_decode(cfg, placement)
    emulated_s = _emulated_decode(cfg, placement, workers)
    emulated_tok_s = cfg.tokens / emulated_s
    return {
        "sim_tok_s": sim["tok_s"],
        "emulated_tok_s": emulated_tok_s,
        "ratio": emulated_tok_s / sim["tok_s"],
        "summed_gbps": cfg.summed_gbps,
        "sim_aggregate_fraction": sim["aggregate_fraction"],
    }


CROSSCHECK_SCENARIOS = (
    "report drives, bandwidth placement",
    "report drives, round-robin (equal) placement",
    "report drives, RAID-0 striping",
    "report drives, bandwidth striping",
    "internal drive alone",
    "fast internal (2x), RAID-0 striping",
    "fast internal (2x), bandwidth striping",
)


def crosscheck_scenarios(shape, drives, *, summed_gbps: float = 1.0, layers: int = 2, tokens: int = 3,
                         seed: int = 0, names: tuple[str, ...] = CROSSCHECK_SCENARIOS) -> list[dict]:
    """The standard scenarios ``names`` (decode, no cache) in the simulator and on emulated drives.

    Where both can run: ``shape`` cut to ``layers`` MoE layers (expert size and count kept), every drive
    rate scaled by the one factor that makes ``drives`` sum to ``summed_gbps`` (latencies kept), so
    this machine can move the bytes. One record per scenario with both tok/s and their ratio.
    """
    from dataclasses import replace

    from deltafin.sim.scenarios import scenario_configs

    small = replace(shape, name=f"{shape.name} ({layers} layers)", layers=min(layers, shape.layers))
    factor = summed_gbps / sum(d.gbps for d in drives)
    out = []
    for cfg in scenario_configs(small, tokens=tokens, prompt=0, seed=seed, drives=tuple(drives), cache_gb=()):
        if cfg.name not in names:
            continue
        cfg = replace(cfg, drives=tuple(d.scaled(factor) for d in cfg.drives), prompt=0, cache_bytes=0)
        reads = small.top_k * (len(cfg.drives) if cfg.layout != "placed" else 1)
        rec = crosscheck(cfg, workers=max(64, reads))
        out.append({"name": cfg.name, "layers": small.layers, "drives": len(cfg.drives), **rec})
    return out
