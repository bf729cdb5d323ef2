"""Tensor shapes and dtypes derived from config.json, for planning a pack from the index alone.

Used when shards are not on disk yet (users plan 1.5 TB of drive space before downloading). When
shards are present their headers are authoritative and these are only checked against them.
"""

from __future__ import annotations

import re

# [header] Kimi K3 stores A_log zero-padded to 128 entries (only the first num_heads are used).
K3_A_LOG_STORED = 128

_K3_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def k3_shapes(tc: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Suffix (after 'model.layers.L.' or the model root) -> (safetensors dtype, shape) for Kimi K3."""
    d, v = tc["hidden_size"], tc["vocab_size"]
    la = tc["linear_attn_config"]
    kh, kd = la["num_heads"], la["head_dim"]
    kw = la["short_conv_kernel_size"]
    nh = tc["num_attention_heads"]
    qk = tc["qk_nope_head_dim"] + tc["qk_rope_head_dim"]
    kvr, qr = tc["kv_lora_rank"], tc["q_lora_rank"]
    E, I, Lat = tc["num_experts"], tc["moe_intermediate_size"], tc["routed_expert_hidden_size"]
    S = tc["num_shared_experts"] * I
    bf, f32 = "BF16", "F32"
    per_layer = {
        "self_attention_res_norm.weight": (bf, (d,)),
        "self_attention_res_proj.weight": (bf, (1, d)),
        "mlp_res_norm.weight": (bf, (d,)),
        "mlp_res_proj.weight": (bf, (1, d)),
        "input_layernorm.weight": (bf, (d,)),
        "post_attention_layernorm.weight": (bf, (d,)),
        # KDA
        "self_attn.q_proj.weight": (bf, (kh * kd, d)),
        "self_attn.k_proj.weight": (bf, (kh * kd, d)),
        "self_attn.v_proj.weight": (bf, (kh * kd, d)),
        "self_attn.q_conv1d.weight": (f32, (kh * kd, 1, kw)),
        "self_attn.k_conv1d.weight": (f32, (kh * kd, 1, kw)),
        "self_attn.v_conv1d.weight": (f32, (kh * kd, 1, kw)),
        "self_attn.f_a_proj.weight": (bf, (kd, d)),
        "self_attn.f_b_proj.weight": (bf, (kh * kd, kd)),
        "self_attn.A_log": (f32, (K3_A_LOG_STORED,)),
        "self_attn.dt_bias": (f32, (kh * kd,)),
        "self_attn.b_proj.weight": (bf, (kh, d)),
        "self_attn.o_norm.weight": (f32, (kd,)),
        # MLA
        "self_attn.q_a_proj.weight": (bf, (qr, d)),
        "self_attn.q_a_layernorm.weight": (bf, (qr,)),
        "self_attn.q_b_proj.weight": (bf, (nh * qk, qr)),
        "self_attn.kv_a_proj_with_mqa.weight": (bf, (kvr + tc["qk_rope_head_dim"], d)),
        "self_attn.kv_a_layernorm.weight": (bf, (kvr,)),
        "self_attn.kv_b_proj.weight": (bf, (nh * (tc["qk_nope_head_dim"] + tc["v_head_dim"]), kvr)),
        # dense layer-0 MLP
        "mlp.gate_proj.weight": (bf, (tc["intermediate_size"], d)),
        "mlp.up_proj.weight": (bf, (tc["intermediate_size"], d)),
        "mlp.down_proj.weight": (bf, (d, tc["intermediate_size"])),
        # latent MoE
        "block_sparse_moe.gate.weight": (bf, (E, d)),
        "block_sparse_moe.gate.e_score_correction_bias": (f32, (E,)),
        "block_sparse_moe.routed_expert_down_proj.weight": (bf, (Lat, d)),
        "block_sparse_moe.routed_expert_norm.weight": (bf, (Lat,)),
        "block_sparse_moe.routed_expert_up_proj.weight": (bf, (d, Lat)),
        "block_sparse_moe.shared_experts.gate_proj.weight": (bf, (S, d)),
        "block_sparse_moe.shared_experts.up_proj.weight": (bf, (S, d)),
        "block_sparse_moe.shared_experts.down_proj.weight": (bf, (d, S)),
    }
    # g_proj (full-rank output gate) and o_proj exist in both layer kinds, with each kind's width.
    mla_w, kda_w = nh * tc["v_head_dim"], kh * kd
    per_layer["self_attn.g_proj.weight"] = (bf, (mla_w, d))
    per_layer["self_attn.o_proj.weight"] = (bf, (d, mla_w))
    kda_only = {"self_attn.g_proj.weight": (bf, (kda_w, d)), "self_attn.o_proj.weight": (bf, (d, kda_w))}
    top = {
        "model.embed_tokens.weight": (bf, (v, d)),
        "lm_head.weight": (bf, (v, d)),
        "model.norm.weight": (bf, (d,)),
        "model.output_attn_res_norm.weight": (bf, (d,)),
        "model.output_attn_res_proj.weight": (bf, (1, d)),
    }
    kda_layers = {i - 1 for i in la.get("kda_layers", [])}  # the config's lists are 1-based
    return {"layer": per_layer, "kda": kda_only, "kda_layers": kda_layers, "top": top}


def k3_trunk_shape(name: str, tables: dict) -> tuple[str, tuple[int, ...]] | None:
    """Look ``name`` up in the tables from :func:`k3_shapes`."""
    m = _K3_LAYER.fullmatch(name)
    if m:
        if int(m.group(1)) in tables["kda_layers"] and m.group(2) in tables["kda"]:
            return tables["kda"][m.group(2)]
        return tables["layer"].get(m.group(2))
    return tables["top"].get(name)


def k3_expert_shape(role: str, kind: str, tc: dict) -> tuple[str, tuple[int, ...]]:
    """compressed-tensors MXFP4 experts: gate/up [I, Lat], down [Lat, I] logical."""
    I, Lat = tc["moe_intermediate_size"], tc["routed_expert_hidden_size"]
    out, inn = (Lat, I) if role == "down" else (I, Lat)
    if kind == "weight_packed":
        return "U8", (out, inn // 2)
    if kind == "weight_scale":
        return "U8", (out, inn // 32)
    raise KeyError(kind)


def swiglu_expert_shape(role: str, tc: dict) -> tuple[int, int]:
    """Logical [out, in] of a standard SwiGLU expert (DeepSeek, Qwen3-MoE, Mixtral, OLMoE)."""
    d = tc["hidden_size"]
    I = tc.get("moe_intermediate_size") or tc["intermediate_size"]
    return (d, I) if role == "down" else (I, d)
