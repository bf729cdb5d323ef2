"""``deltafin bench pack --k3-slice``: pack and run a Kimi K3 slice at the real widths (vocabulary 163,840,
hidden 7,168, real attention, dense-MLP and expert sizes), a few layers and fewer experts per layer. The run
prefills a 512-token prompt (``--slice-prompt``) and reports where its time to first token went.

The source is written here in the real naming (``deltafin.k3_tiny``'s config layout, shapes from
``store.shapes``), random and streamed a block of rows at a time, so writing it needs little memory. Pack and
run each go in a child process whose peak resident memory is reported beside the largest tensor of the
checkpoint (the embedding, 2.35 GB in bf16): the packer converts a block of rows at a time, so its peak
must stay far below ~2x that tensor plus the buffers in flight, whatever the model size.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

# Kimi K3's text_config widths (../shared/specs/kimi-k3/config.json), in k3_tiny.tiny_config's keys.
REAL = dict(hidden_size=7168, vocab_size=163840, intermediate_size=33792, num_attention_heads=96,
            num_key_value_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, kda_heads=96, kda_head_dim=128, moe_intermediate_size=3072,
            routed_expert_hidden_size=3584, num_shared_experts=2, attn_res_block_size=12, mla_every=4)
_KDA_ONLY = {"q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj", "f_b_proj", "A_log",
             "dt_bias", "b_proj", "o_norm"}
_MLA_ONLY = {"q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"}
BLOCK_BYTES = 64 << 20  # float32 bytes generated at a time

# The child's own high-water mark (VmHWM): ru_maxrss would also count the parent's memory at fork time,
# which Linux carries across exec.
_WRAP = ("import sys\nfrom deltafin import cli\nfrom deltafin.store.fileio import peak_rss_bytes\n"
         "rc = cli.main(sys.argv[1:])\nprint(f'peak_rss_bytes={peak_rss_bytes()}', file=sys.stderr)\nsys.exit(rc)\n")


def slice_config(layers: int, experts: int, top_k: int, **widths) -> dict:
    """The slice's config.json: K3's real widths (``widths`` overrides them, for quick checks)."""
    from deltafin.k3_tiny import tiny_config

    return tiny_config(**(REAL | widths), num_hidden_layers=layers, num_experts=experts, num_experts_per_token=top_k)


def _tensor_names(tc: dict) -> dict[str, list[tuple[str, str, tuple[int, ...]]]]:
    """Shard file -> [(name, dtype, shape)] of every text tensor, in the real K3 names."""
    from deltafin.store.shapes import k3_expert_shape, k3_shapes

    tables, n = k3_shapes(tc), tc["num_hidden_layers"]
    kda, dense = tables["kda_layers"], tc["first_k_dense_replace"]
    out: dict[str, list] = {}
    for L in range(n):
        items = []
        for suffix, (dt, shape) in tables["layer"].items():
            part = suffix.split(".")[1] if suffix.startswith("self_attn.") else ""
            if (part in _KDA_ONLY and L not in kda) or (part in _MLA_ONLY and L in kda):
                continue
            if (suffix.startswith("mlp.") and L >= dense) or (suffix.startswith("block_sparse_moe.") and L < dense):
                continue
            if L in kda and suffix in tables["kda"]:
                dt, shape = tables["kda"][suffix]
            items.append((f"language_model.model.layers.{L}.{suffix}", dt, shape))
        if L >= dense:
            for e in range(tc["num_experts"]):
                for w, role in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
                    for kind in ("weight_packed", "weight_scale"):
                        dt, shape = k3_expert_shape(role, kind, tc)
                        items.append((f"language_model.model.layers.{L}.block_sparse_moe.experts.{e}.{w}.{kind}",
                                      dt, shape))
        out[f"model-{L + 1:05d}-of-{n + 1:06d}.safetensors"] = items
    out[f"model-{n + 1:05d}-of-{n + 1:06d}.safetensors"] = [(f"language_model.{k}", dt, s)
                                                             for k, (dt, s) in tables["top"].items()]
    return out


def _chunks(name: str, dtype: str, shape: tuple[int, ...], g: torch.Generator):
    """Random values a block of rows at a time, shaped like a trained model's: norms near 1, linear
    weights ~ N(0, 1/in), MXFP4 codes uniform with scales near 2^0, KDA decay parameters in range."""
    rows, per_row = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
    step = max(1, BLOCK_BYTES // (4 * per_row))
    for a in range(0, rows, step):
        n = min(step, rows - a)
        if name.endswith("weight_scale"):
            t = torch.randint(118, 130, (n * per_row,), generator=g, dtype=torch.uint8)
        elif name.endswith("weight_packed"):
            t = torch.randint(0, 256, (n * per_row,), generator=g, dtype=torch.uint8)
        elif name.endswith("A_log"):
            t = torch.rand(n, generator=g) * math.log(16.0)
        elif name.endswith("dt_bias"):
            t = torch.rand(n, generator=g) * 5 - 4
        elif len(shape) == 1 or name.endswith("_res_proj.weight"):
            t = 1.0 + 0.1 * torch.randn(n * per_row, generator=g)
        else:
            t = torch.randn(n * per_row, generator=g) / math.sqrt(shape[-1] if len(shape) == 2 else 4)
        t = t.to({"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}[dtype])
        yield memoryview(t.contiguous().view(torch.uint8).numpy())


def write_k3_slice(path: str, layers: int = 3, experts: int = 32, top_k: int = 8, seed: int = 0, **widths) -> dict:
    """Write config.json, shards and index of the slice under ``path``; returns the config."""
    from deltafin.store.safetensors_io import write_streamed

    os.makedirs(path, exist_ok=True)
    cfg = slice_config(layers, experts, top_k, **widths)
    g = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for shard, items in _tensor_names(cfg["text_config"]).items():
        specs = [(n, dt, s) for n, dt, s in items]
        meta = {n: (dt, s) for n, dt, s in items}
        size, _ = write_streamed(os.path.join(path, shard), specs, lambda n, meta=meta: _chunks(n, *meta[n], g),
                                 {"format": "pt"})
        weight_map.update({n: shard for n, _dt, _s in items})
        total += size
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return cfg


def largest_tensor_bytes(cfg: dict) -> int:
    from deltafin.store.safetensors_io import nbytes_of

    return max(nbytes_of(dt, s) for items in _tensor_names(cfg["text_config"]).values() for _n, dt, s in items)


def matmul_ops(doc: dict, tc: dict, prompt: int) -> int:
    """Multiplies and adds of a prompt's weight matmuls on the packed slice (``doc`` its manifest, ``tc`` its
    text_config): every 2-D trunk matrix on every token but the embedding (a lookup) and the lm_head (the last
    token only), and each MoE layer's top-k routed experts (gate, up, down) per token. Attention's and KDA's
    token-by-token products are left out: the limit it gives is a lower bound."""
    per_token = last = 0
    for name, meta in doc["trunk"]["tensors"].items():
        shape = meta["shape"]
        if len(shape) != 2 or "embed_tokens" in name:
            continue
        if "lm_head" in name:
            last += shape[0] * shape[1]
        else:
            per_token += shape[0] * shape[1]
    moe_layers = tc["num_hidden_layers"] - tc["first_k_dense_replace"]
    expert = 3 * tc["moe_intermediate_size"] * tc["routed_expert_hidden_size"]
    per_token += moe_layers * tc["num_experts_per_token"] * expert
    return 2 * (per_token * prompt + last)


def _child(argv: list[str]) -> tuple[int, str]:
    """Run a deltafin command in a child process; (peak resident bytes, its stderr)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", _WRAP, *argv], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"deltafin {' '.join(argv[:1])} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    peak = int(r.stderr.strip().splitlines()[-1].split("=")[1])
    return peak, r.stdout + r.stderr


def _baseline() -> int:
    """Peak resident bytes of a process that only imports what pack imports: the floor under every figure."""
    code = ("import torch, deltafin.store.pack, deltafin.runtime.engine\n"
            "from deltafin.store.fileio import peak_rss_bytes\nprint(peak_rss_bytes())")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def run(folder: str | None, layers: int = 3, experts: int = 32, tokens: int = 2, json_path: str | None = None,
        keep: bool = False, prompt: int = 512, **widths) -> dict:
    """Write, pack and run the slice; the run prefills a seeded ``prompt``-token prompt (its time to first token
    and where it went, trunk or expert math or I/O, recorded: the CPU prefill at the real widths) and generates
    ``tokens``."""
    work = tempfile.mkdtemp(prefix="deltafin-k3-slice-", dir=folder)
    try:
        t0 = time.perf_counter()
        cfg = write_k3_slice(os.path.join(work, "src"), layers=layers, experts=experts, **widths)
        t_src = time.perf_counter() - t0
        largest = largest_tensor_bytes(cfg)
        model = os.path.join(work, "model")
        t0 = time.perf_counter()
        pack_peak, _ = _child(["pack", os.path.join(work, "src"), model, "--drive", f"d0:{work}/drive=3",
                               "--create", "--no-progress", "--json", os.path.join(work, "pack.json")])
        t_pack = time.perf_counter() - t0
        with open(os.path.join(work, "pack.json")) as f:
            summary = json.load(f)
        from deltafin.bench.kernels import int16_peak

        peak0 = int16_peak("cpu")  # the run's compute limit, measured before and after it (the higher kept)
        t0 = time.perf_counter()
        vocab = cfg["text_config"]["vocab_size"]
        ids = ",".join(str(1 + (i * 7919) % (vocab - 1)) for i in range(prompt))  # fixed ids across the vocabulary
        run_peak, _ = _child(["run", model, "--prompt-ids", ids, "-n", str(tokens), "--greedy", "--quiet",
                              "--cache-gb", "0", "--stats-json", os.path.join(work, "run.json")])
        t_run = time.perf_counter() - t0
        peak = max(peak0, int16_peak("cpu"))
        with open(os.path.join(work, "run.json")) as f:
            stats = json.load(f)
        with open(os.path.join(model, "deltafin.json")) as f:
            ops = matmul_ops(json.load(f), cfg["text_config"], prompt)
        base = _baseline()
        in_flight = 3 * 17_551_360 + 2 * BLOCK_BYTES  # expert buffers of the writers, blocks being converted
        rec = {
            "bench": "k3_slice", "layers": layers, "experts_per_layer": experts,
            "hidden_size": cfg["text_config"]["hidden_size"], "vocab_size": cfg["text_config"]["vocab_size"],
            "source_seconds": t_src, "pack_seconds": t_pack, "run_seconds": t_run,
            "largest_tensor_bytes": largest, "pack_peak_rss_bytes": pack_peak,
            "pack_peak_vs_largest": pack_peak / largest, "baseline_rss_bytes": base,
            "limit_bytes": 2 * largest + in_flight + base,
            "trunk_bytes": summary["trunk_bytes"], "expert_bytes": summary["expert_bytes"],
            "run_peak_rss_bytes": run_peak, "run_tokens": stats.get("tokens"), "run_prompt_tokens": prompt,
            "run_ttft_s": stats.get("ttft_s"), "run_trunk_math_s": stats.get("trunk_math_s"),
            "run_expert_math_s": stats.get("expert_math_s"), "run_io_wait_s": stats.get("io_wait_s"),
            "run_device": stats.get("device"), "run_matmul_ops": ops,
            "int16_peak_GOPs": peak if stats.get("device") == "cpu" else None,
            "run_matmul_floor_s": ops / (peak * 1e9) if peak and stats.get("device") == "cpu" else None,
        }
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    g = 2**30
    print(f"k3 slice (hidden {rec['hidden_size']}, vocab {rec['vocab_size']:,}, {layers} layers, {experts} "
          f"experts/layer): pack peak RSS {pack_peak / g:.2f} GiB = {rec['pack_peak_vs_largest']:.2f}x the largest "
          f"tensor ({largest / g:.2f} GiB; limit {rec['limit_bytes'] / g:.2f} GiB = 2x + buffers in flight + "
          f"{base / g:.2f} GiB of interpreter and libraries); "
          f"run peak RSS {run_peak / g:.2f} GiB beside a {rec['trunk_bytes'] / g:.2f} GiB trunk; pack "
          f"{t_pack:.0f} s, run {t_run:.0f} s. Run on {rec['run_device']}: a {prompt}-token prompt, time to first "
          f"token {rec['run_ttft_s']:.1f} s (trunk math {rec['run_trunk_math_s']:.1f} s, expert math "
          f"{rec['run_expert_math_s']:.1f} s, waiting on reads {rec['run_io_wait_s']:.1f} s)"
          + (f" vs {rec['run_matmul_floor_s']:.1f} s for its weight matmuls ({ops / 1e12:.2f} TOP) at the int16 "
             f"dot-product peak measured around the run ({peak:.0f} GOP/s) = "
             f"{rec['run_ttft_s'] / rec['run_matmul_floor_s']:.2f}x" if rec["run_matmul_floor_s"] else ""))
    if json_path:
        from deltafin.store.manifest import write_json_atomic

        write_json_atomic(json_path, rec)
    return rec
