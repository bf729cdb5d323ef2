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


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_MLA_FAMILIES = ("deepseek_v3", "kimi_k25", "deepseek_v32")
# families whose trunk shapes config.json gives (``trunk_shape``); Kimi K3 has its own table above
CONFIG_SHAPED = (*_MLA_FAMILIES, "glm4_moe", "minimax_m2", "qwen3_moe", "mixtral", "olmoe", "qwen3_next", "qwen3_5_moe",
                 "deepseek_v4")


def trunk_shape(family: str, local: str, tc: dict) -> tuple[int, ...] | None:
    """Logical shape of trunk tensor ``local`` (packed name) of a ``family`` model from its text config, for a plan
    from config.json and the index alone; None for a name the family does not have."""
    d, v = tc["hidden_size"], tc["vocab_size"]
    top = {"model.embed_tokens.weight": (v, d), "lm_head.weight": (v, d), "model.norm.weight": (d,)}
    if family == "deepseek_v4":
        return _v4(local, tc)
    m = _LAYER.fullmatch(local)
    if m is None:
        return top.get(local)
    table = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,)}
    table |= _mla(tc) if family in _MLA_FAMILIES else _qwen3_next(tc) if family in ("qwen3_next", "qwen3_5_moe") \
        else _gqa(family, tc)
    table |= _mlp(family, tc)
    return table.get(m.group(2))


# DeepSeek-V4 tensors transformers keeps in float32 whatever the checkpoint's dtype (and the int64 hash table)
_V4_F32 = re.compile(r".*(_hc\.(fn|base|scale)|hc_head\.hc_\w+|\.sinks|position_bias|e_score_correction_bias|"
                     r"(q_a_norm|kv_norm|input_layernorm|post_attention_layernorm)\.weight|^model\.norm\.weight)")


def fixed_dtype(family: str, local: str) -> str | None:
    """The dtype a tensor has in every checkpoint of ``family`` regardless of config.json's dtype, else None."""
    if family != "deepseek_v4":
        return None
    return "I64" if local.endswith("tid2eid") else "F32" if _V4_F32.fullmatch(local) else None


def _v4(local: str, tc: dict) -> tuple[int, ...] | None:
    """DeepSeek-V4's trunk shapes: the compressor's widths follow the layer's kind (CSA: two series)."""
    from deltafin.models.deepseek_v4 import CSA, Config

    c = Config.from_dict(tc)
    D, V, N, H, d = c.hidden_size, c.vocab_size, c.hc_mult, c.num_attention_heads, c.head_dim
    top = {"model.embed_tokens.weight": (V, D), "lm_head.weight": (V, D), "model.norm.weight": (D,),
           "model.hc_head.hc_fn": (N, N * D), "model.hc_head.hc_base": (N,), "model.hc_head.hc_scale": (1,)}
    m = _LAYER.fullmatch(local)
    if m is None:
        return top.get(local)
    i, qr, G, r, M = int(m.group(1)), c.q_lora_rank, c.o_groups, c.o_lora_rank, (2 + N) * N
    a, k, x = "self_attn.", "self_attn.compressor.", "self_attn.compressor.indexer."
    two = 2 if c.layer_types[i] == CSA else 1
    Hi, Di, I, E = c.index_n_heads, c.index_head_dim, c.moe_intermediate_size, c.n_routed_experts
    table = {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,), a + "sinks": (H,),
             a + "q_a_proj.weight": (qr, D), a + "q_a_norm.weight": (qr,), a + "q_b_proj.weight": (H * d, qr),
             a + "kv_proj.weight": (d, D), a + "kv_norm.weight": (d,), a + "o_a_proj.weight": (G * r, H * d // G),
             a + "o_b_proj.weight": (D, G * r), k + "kv_proj.weight": (two * d, D), k + "gate_proj.weight": (two * d, D),
             k + "position_bias": (c.rate(i), two * d), k + "kv_norm.weight": (d,),
             x + "kv_proj.weight": (2 * Di, D), x + "gate_proj.weight": (2 * Di, D), x + "position_bias": (c.csa_rate, 2 * Di),
             x + "kv_norm.weight": (Di,), x + "q_b_proj.weight": (Hi * Di, qr), x + "scorer.weights_proj.weight": (Hi, D),
             "mlp.gate.weight": (E, D), "mlp.gate.e_score_correction_bias": (E,),
             "mlp.gate.tid2eid": (V, c.num_experts_per_tok), "mlp.shared_experts.gate_proj.weight": (I, D),
             "mlp.shared_experts.up_proj.weight": (I, D), "mlp.shared_experts.down_proj.weight": (D, I)}
    table |= {f"{n}_hc.{p}": s for n in ("attn", "ffn") for p, s in (("fn", (M, N * D)), ("base", (M,)), ("scale", (3,)))}
    return table.get(m.group(2))


def _mla(tc: dict) -> dict:
    d, H = tc["hidden_size"], tc["num_attention_heads"]
    dn, r, dv, R = tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"], tc["kv_lora_rank"]
    qr = tc.get("q_lora_rank")
    a = "self_attn."
    out = {a + "kv_a_proj_with_mqa.weight": (R + r, d), a + "kv_a_layernorm.weight": (R,),
           a + "kv_b_proj.weight": (H * (dn + dv), R), a + "o_proj.weight": (d, H * dv),
           a + "q_proj.weight": (H * (dn + r), d)}
    if qr:
        out |= {a + "q_a_proj.weight": (qr, d), a + "q_a_layernorm.weight": (qr,), a + "q_b_proj.weight": (H * (dn + r), qr)}
    if tc.get("index_topk"):
        Hi, Di, i = tc["index_n_heads"], tc["index_head_dim"], a + "indexer."
        out |= {i + "wq_b.weight": (Hi * Di, qr), i + "wk.weight": (Di, d), i + "k_norm.weight": (Di,),
                i + "k_norm.bias": (Di,), i + "weights_proj.weight": (Hi, d)}
    return out


def _gqa(family: str, tc: dict) -> dict:
    d, H = tc["hidden_size"], tc["num_attention_heads"]
    Hkv, hd = tc.get("num_key_value_heads") or H, tc.get("head_dim") or d // H
    a = "self_attn."
    whole = family in ("minimax_m2", "olmoe")  # q/k norms over all heads at once
    return {a + "q_proj.weight": (H * hd, d), a + "k_proj.weight": (Hkv * hd, d), a + "v_proj.weight": (Hkv * hd, d),
            a + "o_proj.weight": (d, H * hd), a + "q_proj.bias": (H * hd,), a + "k_proj.bias": (Hkv * hd,),
            a + "v_proj.bias": (Hkv * hd,), a + "q_norm.weight": (H * hd if whole else hd,),
            a + "k_norm.weight": (Hkv * hd if whole else hd,)}


def _qwen3_next(tc: dict) -> dict:
    d, H = tc["hidden_size"], tc["num_attention_heads"]
    Hkv, hd = tc["num_key_value_heads"], tc.get("head_dim") or d // H
    Hk, Hv, dk, dv = (tc[f"linear_{n}"] for n in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"))
    C, a, s = 2 * Hk * dk + Hv * dv, "linear_attn.", "self_attn."
    return {s + "q_proj.weight": (2 * H * hd, d), s + "k_proj.weight": (Hkv * hd, d), s + "v_proj.weight": (Hkv * hd, d),
            s + "o_proj.weight": (d, H * hd), s + "q_norm.weight": (hd,), s + "k_norm.weight": (hd,),
            a + "in_proj_qkvz.weight": (C + Hv * dv, d), a + "in_proj_ba.weight": (2 * Hv, d),
            a + "in_proj_qkv.weight": (C, d), a + "in_proj_z.weight": (Hv * dv, d), a + "in_proj_b.weight": (Hv, d),
            a + "in_proj_a.weight": (Hv, d), a + "conv1d.weight": (C, 1, tc.get("linear_conv_kernel_dim", 4)),
            a + "A_log": (Hv,), a + "dt_bias": (Hv,), a + "norm.weight": (dv,), a + "out_proj.weight": (d, Hv * dv)}


def _mlp(family: str, tc: dict) -> dict:
    """Dense MLP, router, correction bias and shared experts."""
    d = tc["hidden_size"]
    E = tc.get("n_routed_experts") or tc.get("num_experts") or tc.get("num_local_experts")
    inter = tc.get("intermediate_size")
    out = {"mlp.gate_proj.weight": (inter, d), "mlp.up_proj.weight": (inter, d), "mlp.down_proj.weight": (d, inter),
           "mlp.gate.weight": (E, d), "mlp.gate.e_score_correction_bias": (E,),
           "block_sparse_moe.gate.weight": (E, d), "block_sparse_moe.e_score_correction_bias": (E,)}
    if family in ("qwen3_next", "qwen3_5_moe"):
        S, pre = tc["shared_expert_intermediate_size"], "mlp.shared_expert."
        out["mlp.shared_expert_gate.weight"] = (1, d)
    else:
        S, pre = (tc.get("n_shared_experts") or 0) * (tc.get("moe_intermediate_size") or 0), "mlp.shared_experts."
    out |= {pre + "gate_proj.weight": (S, d), pre + "up_proj.weight": (S, d), pre + "down_proj.weight": (d, S)}
    return out


def expert_kind_shape(role: str, kind: str, tc: dict) -> tuple[str, tuple[int, ...]] | None:
    """(dtype, shape) of a released-quantized SwiGLU expert tensor: compressed-tensors INT4 group 32
    (``weight_packed`` / ``weight_scale`` / ``weight_shape``) or DeepSeek FP8's ``weight_scale_inv``."""
    out, inn = swiglu_expert_shape(role, tc)
    return {"weight_packed": ("I32", (out, inn // 8)), "weight_scale": ("BF16", (out, inn // 32)),
            "weight_shape": ("I32", (2,)),
            "weight_scale_inv": ("F32", (-(-out // 128), -(-inn // 128)))}.get(kind)


def v4_release_dtypes(config: dict) -> tuple[str, str]:
    """(expert weight dtype, block scale dtype) of a DeepSeek-V4 release from its config.json, for a plan without
    the shards: ``expert_dtype`` "fp4" (top level or in ``quantization_config``) ships I8-packed FP4 experts, else
    FP8; ``scale_fmt`` "ue8m0" ships F8_E8M0 scales, else F32. Without ``expert_dtype``, E8M0 scales mean FP4
    experts (V4-Flash), float ones FP8 (V4-Flash-Base)."""
    q = config.get("quantization_config") if isinstance(config.get("quantization_config"), dict) else {}
    scale = "F8_E8M0" if q.get("scale_fmt") == "ue8m0" else "F32"
    kind = config.get("expert_dtype") or q.get("expert_dtype") or ("fp4" if scale == "F8_E8M0" else "fp8")
    return ("I8" if kind == "fp4" else "F8_E4M3"), scale
