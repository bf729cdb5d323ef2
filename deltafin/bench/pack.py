"""``deltafin bench pack``: pack throughput beside the disk's raw write rate, measured in the same run.

The source is a synthetic checkpoint in the Kimi K3 layout with real-size MXFP4 experts (17,547,264
bytes each, copied unchanged by the packer), so the figure is the packer's own cost per expert byte.
``--bf16`` packs a random bf16 Qwen3-MoE at the issue's widths instead (bench peer's checkpoint, 2 layers
of 64 experts) to the default pack, MXFP4 experts and an int8 trunk: the figure is the conversion's cost.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import numpy as np

from deltafin.bench.disk import raw_write_gbps

K3_EXPERT_BYTES = 17_547_264
K3_TOTAL_EXPERT_BYTES = 82_432 * K3_EXPERT_BYTES
LATENT, INTER = 3584, 3072
SHARD_EXPERTS = 8


def synthetic_k3_source(path: str, layers: int, experts: int, seed: int = 0) -> None:
    """K3-named checkpoint: a dense layer 0 stand-in and ``layers`` MoE layers of real-size MXFP4 experts."""
    from safetensors.numpy import save_file

    from deltafin.k3_tiny import tiny_config

    rng = np.random.default_rng(seed)
    os.makedirs(path, exist_ok=True)
    # The K3 config layout with real expert sizes; only the experts (and two stand-in tensors) are written.
    cfg = tiny_config(num_hidden_layers=layers + 1, num_experts=experts, hidden_size=256, vocab_size=1024,
                      routed_expert_hidden_size=LATENT, moe_intermediate_size=INTER)
    weight_map = {}
    for L in range(1, layers + 1):
        for first in range(0, experts, SHARD_EXPERTS):  # small shards keep this generator's memory low
            shard = f"model-{L:05d}-{first:05d}.safetensors"
            tensors = {}
            for e in range(first, min(first + SHARD_EXPERTS, experts)):
                for w, (out, inn) in (("w1", (INTER, LATENT)), ("w2", (LATENT, INTER)), ("w3", (INTER, LATENT))):
                    p = f"language_model.model.layers.{L}.block_sparse_moe.experts.{e}.{w}"
                    tensors[f"{p}.weight_packed"] = rng.integers(0, 256, (out, inn // 2), dtype=np.uint8)
                    tensors[f"{p}.weight_scale"] = rng.integers(118, 130, (out, inn // 32), dtype=np.uint8)
            save_file(tensors, os.path.join(path, shard))
            weight_map.update({k: shard for k in tensors})
    glob = {"language_model.model.embed_tokens.weight": rng.standard_normal((1024, 256), dtype=np.float32),
            "language_model.lm_head.weight": rng.standard_normal((1024, 256), dtype=np.float32),
            # the dense layer 0's stand-in: pack checks that the weights hold every layer the config declares
            "language_model.model.layers.0.input_layernorm.weight": np.ones(256, dtype=np.float32)}
    save_file(glob, os.path.join(path, "model-global.safetensors"))
    weight_map.update({k: "model-global.safetensors" for k in glob})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _warm(folder: str) -> None:
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            while f.read(64 << 20):
                pass


def _timed_pack(src: str, work: str, probe_bytes: int, gbps: float, opts) -> tuple:
    """(summary, seconds, raw write GB/s) of packing ``src`` from the page cache into ``work``. The ceiling is the
    disk's raw direct write rate at the packer's concurrency, probed before and after the pack (this disk's rate
    drifts; the higher of the two is the stricter limit)."""
    from deltafin.store.drives import DriveArg
    from deltafin.store.pack import WRITERS, pack

    _warm(src)  # the source comes from the page cache: the figure is the packer's, not the source disk's
    raw_before = raw_write_gbps(work, probe_bytes, WRITERS)
    t0 = time.perf_counter()
    s = pack(src, os.path.join(work, "out"), [DriveArg("d0", os.path.join(work, "drive"), gbps)], opts)
    dt = time.perf_counter() - t0
    return s, dt, max(raw_before, raw_write_gbps(work, probe_bytes, WRITERS))


def run(folder: str | None, gb: float, json_path: str | None = None) -> dict:
    from deltafin.store.pack import PackOptions

    work = tempfile.mkdtemp(prefix="deltafin-bench-pack-", dir=folder)
    try:
        experts = max(int(gb * 1e9 / K3_EXPERT_BYTES / 2), 1)
        src = os.path.join(work, "src")
        synthetic_k3_source(src, layers=2, experts=experts)
        s, dt, raw = _timed_pack(src, work, int(gb * 1e9), 1.0, PackOptions(trunk="bf16", progress=False))
        rate = s.bytes_written / dt / 1e9
        rec = {
            "bench": "pack", "expert_files": s.expert_files, "bytes_written": s.bytes_written, "seconds": dt,
            "pack_GBps": rate, "raw_write_GBps": raw, "ratio": rate / raw, "target_ratio": 0.70,
            "peak_rss_bytes": s.peak_rss_bytes,
            "k3_projected_hours": K3_TOTAL_EXPERT_BYTES / (rate * 1e9) / 3600,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"pack {rec['pack_GBps']:.2f} GB/s vs raw write {raw:.2f} GB/s = {rec['ratio']:.2f}x (target >= 0.70); "
          f"{s.expert_files} K3-size experts, peak RSS {rec['peak_rss_bytes'] / 2**20:,.0f} MiB; Kimi K3 "
          f"(1.45 TB of experts) would pack in {rec['k3_projected_hours']:.2f} h at this rate")
    return _kept(rec, json_path)


def _kept(rec: dict, json_path: str | None) -> dict:
    """The record, written to ``json_path`` (atomically) where one is given."""
    if json_path:
        from deltafin.store.manifest import write_json_atomic

        write_json_atomic(json_path, rec)
    return rec


def check_bf16_args(bf16: bool, k3_slice: bool, checkpoint: str | None) -> None:
    """Before any work: one benchmark at a time, and --checkpoint a folder this benchmark may write (new,
    empty, or the random checkpoint it built before: a real model there is never written over)."""
    from deltafin.bench.peer_tools import same_shape
    from deltafin.errors import UsageError

    if bf16 and k3_slice:
        raise UsageError("bench pack: --bf16 and --k3-slice are two benchmarks; give one of them")
    if checkpoint is None:
        return
    if not bf16:
        raise UsageError(f"bench pack: --checkpoint {checkpoint} is where --bf16 builds its random checkpoint; add "
                         f"--bf16 or leave --checkpoint out")
    if os.path.isdir(checkpoint) and os.listdir(checkpoint):
        try:
            with open(os.path.join(checkpoint, "config.json")) as f:
                cfg = json.load(f)
        except (OSError, ValueError):
            cfg = {}
        if not isinstance(cfg, dict) or not same_shape(cfg, "pack"):
            raise UsageError(f"bench pack: --checkpoint {checkpoint} holds something other than this benchmark's "
                             f"random checkpoint; give a new or empty folder")
    elif os.path.exists(checkpoint) and not os.path.isdir(checkpoint):
        raise UsageError(f"bench pack: --checkpoint {checkpoint} is a file; give a new or empty folder")


def run_bf16(folder: str | None, checkpoint: str | None, json_path: str | None = None) -> dict:
    """Pack a random bf16 Qwen3-MoE (built at ``checkpoint`` if missing, kept there) to MXFP4 experts and an
    int8 trunk, from the page cache; the time beside the raw direct write rate before and after."""
    from deltafin.bench.peer_tools import build_checkpoint
    from deltafin.store.pack import PackOptions

    work = tempfile.mkdtemp(prefix="deltafin-bench-pack-", dir=folder)
    try:
        src = checkpoint or os.path.join(work, "src")
        build_checkpoint(src, "pack")
        src_bytes = sum(os.path.getsize(os.path.join(src, n)) for n in os.listdir(src) if n.endswith(".safetensors"))
        s, dt, raw = _timed_pack(src, work, src_bytes // 3, 2.0, PackOptions(progress=False))
        rate = s.bytes_written / dt / 1e9
        rec = {"bench": "pack-bf16", "source_bytes": src_bytes, "expert_files": s.expert_files,
               "bytes_written": s.bytes_written, "seconds": dt, "source_GBps": src_bytes / dt / 1e9,
               "pack_GBps": rate, "raw_write_GBps": raw, "ratio": rate / raw, "peak_rss_bytes": s.peak_rss_bytes}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"pack bf16 -> MXFP4 experts + int8 trunk: {src_bytes / 1e9:.2f} GB in {dt:.1f} s ({rec['source_GBps']:.3f} "
          f"GB/s of source); wrote {s.bytes_written / 1e9:.2f} GB at {rate:.3f} GB/s vs raw write {raw:.2f} GB/s = "
          f"{rec['ratio']:.2f}x; peak RSS {s.peak_rss_bytes / 2**20:,.0f} MiB")
    return _kept(rec, json_path)
