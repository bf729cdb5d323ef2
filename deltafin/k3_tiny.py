"""A tiny Kimi K3-shaped checkpoint, written locally with random weights in the real K3 naming and layout.

Scaled dimensions, real structure (../shared/specs/KIMI_K3.md §1-2): a top-level ``kimi_k3`` config with a
``kimi_linear`` text_config and its compressed-tensors quantization_config; KDA and MLA layers on the
real 1-based schedule (every 4th layer MLA, the last two both MLA); AttnRes blocks; a dense layer 0 and
latent MoE after it; routed experts as MXFP4 ``weight_packed``/``weight_scale`` bytes; F32 conv, A_log
(zero-padded past num_heads), dt_bias, o_norm and correction bias; one shard per layer, then the
top-level tensors, then mm_projector and vision_tower shards that a text engine skips.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from deltafin.quant import mxfp4

A_LOG_STORED = 128  # §2.1 [header]: A_log is stored as [128], zero past num_heads

# Kimi K3's text_config with every width scaled down (widths multiples of 32 where MXFP4 needs it).
# kda_heads / kda_head_dim fill linear_attn_config; every mla_every-th layer (1-based) and the last are MLA.
TINY_TEXT: dict = dict(
    hidden_size=64, vocab_size=256, num_hidden_layers=13, intermediate_size=128,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    kda_heads=2, kda_head_dim=32, num_experts=8, num_experts_per_token=2, moe_intermediate_size=64,
    routed_expert_hidden_size=32, num_shared_experts=2, attn_res_block_size=4, mla_every=4,
)

QUANTIZATION_CONFIG = {  # §1.2, as shipped
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized", "input_activations": None, "output_activations": None,
        "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
                    "symmetric": True, "type": "float", "zp_dtype": None},
    }},
    "format": "mxfp4-pack-quantized", "global_compression_ratio": None,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}


def tiny_config(**overrides) -> dict:
    """The top-level config.json of the tiny model (overrides apply to TINY_TEXT keys)."""
    t = {**TINY_TEXT, **overrides}
    n, every = t["num_hidden_layers"], t["mla_every"]
    full = sorted(set(range(every, n + 1, every)) | {n})  # like K3's [4, 8, ..., 92, 93]
    kda = [i for i in range(1, n + 1) if i not in full]
    text = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "hidden_size": t["hidden_size"], "vocab_size": t["vocab_size"], "num_hidden_layers": n,
        "rms_norm_eps": 1e-5, "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "first_k_dense_replace": 1, "intermediate_size": t["intermediate_size"], "moe_layer_freq": 1,
        "num_attention_heads": t["num_attention_heads"], "num_key_value_heads": t["num_key_value_heads"],
        "q_lora_rank": t["q_lora_rank"], "kv_lora_rank": t["kv_lora_rank"],
        "qk_nope_head_dim": t["qk_nope_head_dim"], "qk_rope_head_dim": t["qk_rope_head_dim"],
        "v_head_dim": t["v_head_dim"], "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {
            "full_attn_layers": full, "kda_layers": kda, "gate_lower_bound": -5.0, "head_dim": t["kda_head_dim"],
            "num_heads": t["kda_heads"], "short_conv_kernel_size": 4, "use_full_rank_gate": True,
        },
        "num_experts": t["num_experts"], "num_experts_per_token": t["num_experts_per_token"],
        "num_shared_experts": t["num_shared_experts"], "moe_intermediate_size": t["moe_intermediate_size"],
        "routed_expert_hidden_size": t["routed_expert_hidden_size"], "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc", "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 1.0,
        "attn_res_block_size": t["attn_res_block_size"], "num_nextn_predict_layers": 0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "dtype": "bfloat16",
        "bos_token_id": 253, "eos_token_id": 254, "pad_token_id": 255,
        "quantization_config": QUANTIZATION_CONFIG,
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text,
        "bos_token_id": 253, "eos_token_id": 254, "pad_token_id": 255, "tie_word_embeddings": False,
        "dtype": "bfloat16", "vision_config": {"vt_hidden_size": 32, "vt_num_hidden_layers": 1},
    }


class _Rand:
    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def normal(self, shape, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=self.g) * std + mean

    def linear(self, out: int, inn: int, gain: float = 1.0) -> torch.Tensor:
        return self.normal((out, inn), gain / inn**0.5).to(torch.bfloat16)

    def norm(self, n: int) -> torch.Tensor:
        return self.normal((n,), 0.1, 1.0).to(torch.bfloat16)

    def uniform(self, shape, lo: float, hi: float) -> torch.Tensor:
        return torch.rand(shape, generator=self.g) * (hi - lo) + lo


def _common(r: _Rand, d: int) -> dict[str, torch.Tensor]:
    out = {}
    for part in ("self_attention_res", "mlp_res"):
        out[f"{part}_norm.weight"] = r.norm(d)
        out[f"{part}_proj.weight"] = r.normal((1, d), 0.1).to(torch.bfloat16)
    out["input_layernorm.weight"] = r.norm(d)
    out["post_attention_layernorm.weight"] = r.norm(d)
    return out


def _kda(r: _Rand, tc: dict) -> dict[str, torch.Tensor]:
    d, la = tc["hidden_size"], tc["linear_attn_config"]
    H, K, W = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    C = H * K
    a_log = torch.zeros(max(A_LOG_STORED, H))
    a_log[:H] = r.uniform(H, 1.0, 16.0).log()  # fla init: A ~ U(1, 16)
    out = {f"{n}_proj.weight": r.linear(C, d) for n in "qkv"}
    out |= {f"{n}_conv1d.weight": r.normal((C, 1, W), 0.5) for n in "qkv"}  # F32
    out |= {
        "f_a_proj.weight": r.linear(K, d), "f_b_proj.weight": r.linear(C, K),
        "A_log": a_log, "dt_bias": r.uniform(C, -4.0, 1.0),
        "b_proj.weight": r.linear(H, d), "g_proj.weight": r.linear(C, d),
        "o_norm.weight": r.normal((K,), 0.1, 1.0), "o_proj.weight": r.linear(d, C),
    }
    return out


def _mla(r: _Rand, tc: dict) -> dict[str, torch.Tensor]:
    d, nh = tc["hidden_size"], tc["num_attention_heads"]
    qk, v = tc["qk_nope_head_dim"] + tc["qk_rope_head_dim"], tc["v_head_dim"]
    qr, kvr = tc["q_lora_rank"], tc["kv_lora_rank"]
    return {
        "q_a_proj.weight": r.linear(qr, d), "q_a_layernorm.weight": r.norm(qr),
        "q_b_proj.weight": r.linear(nh * qk, qr, 2.0),
        "kv_a_proj_with_mqa.weight": r.linear(kvr + tc["qk_rope_head_dim"], d), "kv_a_layernorm.weight": r.norm(kvr),
        "kv_b_proj.weight": r.linear(nh * (tc["qk_nope_head_dim"] + v), kvr, 2.0),
        "o_proj.weight": r.linear(d, nh * v), "g_proj.weight": r.linear(nh * v, d),
    }


def _glu(r: _Rand, d: int, inter: int) -> dict[str, torch.Tensor]:
    return {"gate_proj.weight": r.linear(inter, d, 2.0), "up_proj.weight": r.linear(inter, d, 2.0),
            "down_proj.weight": r.linear(d, inter)}


def _moe(r: _Rand, tc: dict) -> dict[str, torch.Tensor]:
    d, E, lat, inter = tc["hidden_size"], tc["num_experts"], tc["routed_expert_hidden_size"], tc["moe_intermediate_size"]
    out = {
        "gate.weight": r.linear(E, d, 2.0), "gate.e_score_correction_bias": r.normal((E,), 0.05),
        "routed_expert_down_proj.weight": r.linear(lat, d, 2.0), "routed_expert_norm.weight": r.norm(lat),
        "routed_expert_up_proj.weight": r.linear(d, lat),
    }
    out |= {f"shared_experts.{n}": t for n, t in _glu(r, d, inter * tc["num_shared_experts"]).items()}
    for e in range(E):  # w1 = gate, w3 = up, w2 = down (§2.3), MXFP4 as compressed-tensors bytes
        for w, (o, i) in (("w1", (inter, lat)), ("w2", (lat, inter)), ("w3", (inter, lat))):
            packed, scale = mxfp4.quantize(r.normal((o, i), 2.0 / i**0.5))
            out[f"experts.{e}.{w}.weight_packed"] = packed
            out[f"experts.{e}.{w}.weight_scale"] = scale
    return out


def tiny_tensors(config: dict, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Checkpoint tensors by shard file name, in the real K3 names (text under 'language_model.')."""
    r, tc = _Rand(seed), config["text_config"]
    n, d, v = tc["num_hidden_layers"], tc["hidden_size"], tc["vocab_size"]
    kda_layers = set(tc["linear_attn_config"]["kda_layers"])
    total = n + 3
    shard = lambda i: f"model-{i:05d}-of-{total:06d}.safetensors"  # noqa: E731  (the real names' widths)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for L in range(n):
        t = _common(r, d)
        t |= {f"self_attn.{k}": x for k, x in (_kda(r, tc) if L + 1 in kda_layers else _mla(r, tc)).items()}
        if L < tc["first_k_dense_replace"]:
            t |= {f"mlp.{k}": x for k, x in _glu(r, d, tc["intermediate_size"]).items()}
        else:
            t |= {f"block_sparse_moe.{k}": x for k, x in _moe(r, tc).items()}
        shards[shard(L + 1)] = {f"language_model.model.layers.{L}.{k}": x for k, x in t.items()}
    shards[shard(n + 1)] = {
        "language_model.model.embed_tokens.weight": r.normal((v, d), 1.0).to(torch.bfloat16),
        "language_model.lm_head.weight": r.linear(v, d, 4.0),
        "language_model.model.norm.weight": r.norm(d),
        "language_model.model.output_attn_res_norm.weight": r.norm(d),
        "language_model.model.output_attn_res_proj.weight": r.normal((1, d), 0.1).to(torch.bfloat16),
    }
    shards[shard(n + 2)] = {"mm_projector.proj.0.weight": r.linear(d, 128), "mm_projector.post_norm.weight": r.norm(d)}
    shards[shard(n + 3)] = {"vision_tower.encoder.blocks.0.wqkv.weight": r.linear(96, 32),
                            "vision_tower.encoder.final_layernorm.weight": r.norm(32)}
    return shards


def write_tiny_k3(path: str | os.PathLike, seed: int = 0, **overrides) -> dict:
    """Write config.json, the shards and model.safetensors.index.json under ``path``; returns the config."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    config = tiny_config(**overrides)
    weight_map, total = {}, 0
    for name, tensors in tiny_tensors(config, seed).items():
        save_file({k: x.contiguous() for k, x in tensors.items()}, os.path.join(path, name), metadata={"format": "pt"})
        for k, x in tensors.items():
            weight_map[k] = name
            total += x.numel() * x.element_size()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return config


# Named special tokens of the tiny tokenizer, placed right after the 256 byte ranks (§5.1 names).
TINY_SPECIALS = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "[UNK]", "[PAD]"]
TINY_TOKENIZER_VOCAB = 256 + len(TINY_SPECIALS)


def write_tiny_k3_tokenizer(path: str | os.PathLike) -> None:
    """A byte-level tiktoken rank file and a tokenizer_config.json naming K3's specials at small ids.

    Pair it with ``write_tiny_k3(path, vocab_size=TINY_TOKENIZER_VOCAB)``; config eos ids are updated to
    ``<|end_of_msg|>`` as in the real checkpoint.
    """
    import base64

    path = os.fspath(path)
    with open(os.path.join(path, "tiktoken.model"), "w") as f:
        for b in range(256):
            f.write(f"{base64.b64encode(bytes([b])).decode()} {b}\n")
    decoder = {str(256 + i): {"content": name, "special": name not in ("<|open|>", "<|close|>", "<|sep|>")}
               for i, name in enumerate(TINY_SPECIALS)}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "TikTokenTokenizer", "added_tokens_decoder": decoder}, f, indent=1)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    eom = 256 + TINY_SPECIALS.index("<|end_of_msg|>")
    ids = {"bos_token_id": 256, "eos_token_id": eom, "pad_token_id": 256 + TINY_SPECIALS.index("[PAD]")}
    cfg.update(ids)
    cfg["text_config"].update(ids)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
