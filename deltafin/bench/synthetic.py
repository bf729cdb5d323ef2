"""A synthetic packed model with Kimi K3's real expert size, written straight into the store format.

Only the routed experts are real-size (MXFP4 gate/up [3072, 3584], down [3584, 3072]: 17,547,264 payload
bytes); there is no trunk. Benchmarks drive it with seeded random routing.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from deltafin.io.pool import BufferPool
from deltafin.quant.record import QTensor
from deltafin.store import expert_file as ef
from deltafin.store import manifest as mf
from deltafin.store.expert_file import layout_for

K3_LATENT, K3_INTER = 3584, 3072


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
                    seed: int = 0, model_id: str = "synthetic-k3") -> str:
    """Write a packed model at ``root`` with experts placed over ``drives`` [(label, path, GB/s)]."""
    from deltafin.store.placement import DriveSpec, place

    os.makedirs(root, exist_ok=True)
    layout = k3_expert_layout()
    specs = [DriveSpec(label, gbps) for label, _, gbps in drives]
    locs = place({L: [layout.file_bytes] * experts for L in range(1, layers + 1)}, specs)
    rng = np.random.default_rng(seed)
    base = [random_expert(rng) for _ in range(4)]  # a few distinct payloads, reused: generation stays fast
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
           "num_experts_per_token": 16, "routed_expert_hidden_size": K3_LATENT, "moe_intermediate_size": K3_INTER}}
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
        },
        "drives": [{"label": label, "path": os.path.abspath(path), "gbps": gbps, "measured": False}
                   for label, path, gbps in drives],
    }
    mf.write_json_atomic(os.path.join(root, mf.MANIFEST), doc)
    return root
