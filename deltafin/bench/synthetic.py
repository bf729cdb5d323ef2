"""A synthetic packed model with Kimi K3's real expert size, written straight into the store format.

Only the routed experts are real-size (MXFP4 gate/up [3072, 3584], down [3584, 3072]: 17,547,264 payload
bytes); there is no trunk. Benchmarks drive it with seeded random routing.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch

from deltafin.io.pool import BufferPool
from deltafin.quant.record import QTensor
from deltafin.store import expert_file as ef
from deltafin.store import manifest as mf
from deltafin.store.expert_file import layout_for

K3_LATENT, K3_INTER = 3584, 3072
K3_ACT = ("situ", 4.0, 25.0)  # Kimi K3's expert activation: SiTU-GLU, beta 4, linear beta 25


def k3_expert_layout(latent: int = K3_LATENT, inter: int = K3_INTER) -> ef.ExpertLayout:
    def mx(out: int, inn: int):
        return [("data", "uint8", (out, inn // 2)), ("scale", "uint8", (out, inn // 32))]

    return layout_for([("gate", "mxfp4", (inter, latent), mx(inter, latent)),
                       ("up", "mxfp4", (inter, latent), mx(inter, latent)),
                       ("down", "mxfp4", (latent, inter), mx(latent, inter))])


def random_expert(rng: np.random.Generator, latent: int = K3_LATENT, inter: int = K3_INTER) -> dict[str, QTensor]:
    def mx(out: int, inn: int) -> QTensor:
        packed = torch.from_numpy(rng.integers(0, 256, (out, inn // 2), dtype=np.uint8))
        scales = torch.from_numpy(rng.integers(118, 124, (out, inn // 32), dtype=np.uint8))
        return QTensor("mxfp4", (out, inn), packed, scales)

    return {"gate": mx(inter, latent), "up": mx(inter, latent), "down": mx(latent, inter)}


def write_synthetic(root: str, drives: list[tuple[str, str, float]], layers: int, experts: int,
                    seed: int = 0, model_id: str = "synthetic-k3", ranks: str | None = None,
                    shape: tuple[int, int] = (K3_LATENT, K3_INTER)) -> str:
    """Write a packed model at ``root`` with experts placed over ``drives`` [(label, path, GB/s)];
    ``ranks`` (``deltafin place --ranks`` grammar): owned over a cluster's ranks, each on its own drives;
    ``shape``: an expert's (hidden, intermediate) widths, Kimi K3's unless given."""
    from deltafin.store.placement import DriveSpec, place

    os.makedirs(root, exist_ok=True)
    layout = k3_expert_layout(*shape)
    specs = [DriveSpec(label, gbps) for label, _, gbps in drives]
    locs = place({L: [layout.file_bytes] * experts for L in range(1, layers + 1)}, specs)
    owned = None
    if ranks is not None:
        from deltafin.store import ranks as rk

        labels = [d.label for d in specs]
        plan = rk.parse_ranks(ranks, labels)
        groups = [[labels.index(x) for x in r.drives] for r in plan]
        rates = [d.gbps for d in specs]
        counts = rk.quotas(experts, layout.file_bytes * layers, plan, [sum(rates[d] for d in g) for g in groups])
        owners, locs = rk.plan_owners(locs, {L: layout.file_bytes for L in locs}, rates, groups, counts)
        owned = rk.ranks_doc(plan, owners)
    rng = np.random.default_rng(seed)
    base = [random_expert(rng, *shape) for _ in range(4)]  # a few distinct payloads, reused: generation stays fast
    pool = BufferPool()
    sums: dict[str, list[str]] = {}

    def one(job: tuple[int, int]) -> str:
        L, e = job
        buf = pool.get(layout.file_bytes)
        try:
            data = ef.encode_into(base[(L * 7 + e) % len(base)], L, e, buf)
            for d in locs[L][e]:
                path = mf.resolve_under(drives[d][1], mf.expert_relpath(model_id, L, e))
                ef.write_atomic(path, data, direct=True)
            return ef.checksum(data)
        finally:
            pool.put(buf)

    with ThreadPoolExecutor(3) as ex:
        for L in range(1, layers + 1):
            sums[str(L)] = list(ex.map(one, [(L, e) for e in range(experts)]))
    cfg = {"model_type": "kimi_k3", "text_config": {"num_hidden_layers": layers + 1, "num_experts": experts,
           "num_experts_per_token": min(16, experts), "routed_expert_hidden_size": shape[0], "moe_intermediate_size": shape[1]}}
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(cfg, f)
    doc = {
        "format": mf.FORMAT, "version": mf.VERSION, "model_id": model_id, "family": "kimi_k3",
        "model_type": "kimi_k3", "config": "config.json", "source": {"path": "synthetic"},
        "trunk": {"bytes": 0, "default": "bf16", "tensors": {}},
        "experts": {
            "layers": list(range(1, layers + 1)), "num_experts": experts, "placement": "bandwidth",
            "layouts": {str(L): {"file_bytes": layout.file_bytes, "payload_bytes": layout.payload_bytes,
                                 "tensors": [{"name": t.name, "format": t.format, "shape": list(t.shape)}
                                             for t in layout.tensors]} for L in range(1, layers + 1)},
            "locations": {str(L): locs[L] for L in range(1, layers + 1)},
            "checksums": sums,
        } | ({"ranks": owned} if owned is not None else {}),
        "drives": [{"label": label, "path": os.path.abspath(path), "gbps": gbps, "measured": False}
                   for label, path, gbps in drives],
    }
    mf.write_json_atomic(os.path.join(root, mf.MANIFEST), doc)
    return root


class SyntheticRun:
    """A synthetic model written under a scratch folder, with the drive's raw direct read rate measured
    before the run (``raw``) and again by :meth:`remeasure` after it; the higher is the stricter limit. ``probes``
    keeps both readings (a virtual disk's host may cache what the run just read: the second can read faster)."""

    def __init__(self, root: str, seed: int, inflight: int, sample: int = 48):
        from deltafin.store.model_dir import PackedModel

        self.pm = PackedModel.open(root)
        tc = self.pm.text_config
        self.latent, self.inter = tc["routed_expert_hidden_size"], tc["moe_intermediate_size"]  # an expert's widths
        self.nbytes = self.pm.file_bytes(self.pm.moe_layers[0])
        paths = [self.pm.expert_path(L, e) for L in self.pm.moe_layers for e in range(self.pm.num_experts)]
        import random

        random.Random(seed).shuffle(paths)
        self._probe = paths[: max(sample, 4 * inflight)]
        self.inflight = inflight
        self.raw = self._measure()
        self.probes = [self.raw]

    def _measure(self) -> float:
        from deltafin.bench.disk import raw_read_gbps

        return raw_read_gbps(self._probe, self.nbytes, self.inflight)

    def remeasure(self) -> float:
        self.probes.append(self._measure())
        self.raw = max(self.raw, self.probes[-1])
        return self.raw

    def source(self, threads: int, device: str, verify: bool = True):
        from deltafin.runtime.source import StreamingExperts

        return StreamingExperts(self.pm, cache_bytes=0, threads=threads, device=device, verify=verify)


@contextmanager
def synthetic_run(args, name: str, inflight: int | None = None) -> Iterator[SyntheticRun]:
    """Write the synthetic model for a benchmark (``args``: dir, layers, experts, seed, threads), yield it,
    and remove it afterwards. The arguments are checked first, each mistake one line."""
    from deltafin.errors import UsageError

    if args.dir is not None and not os.path.isdir(args.dir):
        raise UsageError(f"bench {name}: --dir {args.dir}: no such folder; create it (mkdir -p {args.dir}) or pick "
                         f"another")
    if args.layers < 1 or args.experts < 1 or getattr(args, "k", 1) < 1:
        raise UsageError(f"bench {name}: --layers, --experts and --k must be at least 1")
    if getattr(args, "k", 0) > args.experts:
        raise UsageError(f"bench {name}: --k {args.k} routes more experts than a layer has (--experts {args.experts}); "
                         f"lower --k or raise --experts")
    work = tempfile.mkdtemp(prefix=f"deltafin-bench-{name}-", dir=args.dir)
    try:
        root = write_synthetic(os.path.join(work, "model"), [("d0", os.path.join(work, "d0"), 1.0)],
                               args.layers, args.experts, seed=args.seed,
                               shape=getattr(args, "expert_shape", None) or (K3_LATENT, K3_INTER))
        yield SyntheticRun(root, args.seed, inflight or args.threads)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def reserved_line(reserved: tuple[int, int, float]) -> str:
    """What the source mapped when it opened (``StreamingExperts.reserved``), outside the timed part."""
    n, nbytes, s = reserved
    return (f"Read buffers mapped at open, outside the timing: {n} ({nbytes / 1e9:.2f} GB) in {s:.2f} s" if n else
            "No read buffers mapped at open")


def expert_rows(token_routes: list[list[int]]) -> dict[int, torch.Tensor]:
    """Expert -> the rows (tokens, ascending) routed to it, int64: one pass over the routes per layer."""
    rows: dict[int, list[int]] = {}
    for i, tok in enumerate(token_routes):
        for e in tok:
            rows.setdefault(e, []).append(i)
    return {e: torch.tensor(r, dtype=torch.int64) for e, r in rows.items()}


def expert_major_layer(source, layer: int, token_routes: list[list[int]], x: torch.Tensor, io_only: bool,
                       expert_fn) -> tuple[int, float]:
    """One layer of expert-major prefill: fetch the union of the tokens' experts once and run each expert
    on all of its tokens (unless ``io_only``): ``expert_fn(x, tensors, rows)``, its tokens rows of x (the fused
    CPU expert reads them in place; no gathered copy). Returns (unique experts, seconds of expert math)."""
    union = sorted({e for tok in token_routes for e in tok})
    m0 = time.perf_counter()
    rows = {} if io_only else expert_rows(token_routes)
    math_s = 0.0 if io_only else time.perf_counter() - m0
    for e, t in source.fetch(layer, union):
        if not io_only:
            m0 = time.perf_counter()
            expert_fn(x, t, rows[e])
            math_s += time.perf_counter() - m0
    return len(union), math_s
