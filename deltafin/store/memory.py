"""What stays resident and what streams: trunk at int8 and bf16, sequence state, cache growth, bytes/token."""

from __future__ import annotations

from math import prod

F32 = 4


def trunk_bytes_both(tensors: dict[str, dict]) -> tuple[int, int]:
    """(int8 trunk bytes, bf16 trunk bytes) from manifest-style {name: {format, shape}} entries.

    int8 applies to 2D weights (one float32 scale per row); float32 tensors (e.g. KDA conv, A_log) and
    routers stay as they are in both.
    """
    int8 = bf16 = 0
    for t in tensors.values():
        n, fmt, shape = prod(t["shape"]), t["format"], t["shape"]
        if fmt == "int8":
            int8 += n + F32 * shape[0]
            bf16 += 2 * n
        else:
            size = {"bf16": 2, "f16": 2, "f32": 4}[fmt] * n
            int8 += size
            bf16 += size
    return int8, bf16


def state_sizes(tc: dict) -> tuple[int, int, int, int]:
    """(recurrent state bytes per sequence, cache values per token, attention layers, recurrent layers).

    Recurrent state (Kimi K3's KDA, Qwen3-Next / Qwen3.5's Gated DeltaNet) does not grow with the context: the
    delta-rule state in float32 plus the short conv history. The cache holds, per token and attention layer,
    the MLA latent and rope key (and DSA's indexer key), or K and V.
    """
    if tc.get("model_type") == "deepseek_v4":
        fixed, per_tok = _v4_state(tc)
        return fixed * F32, per_tok, tc.get("num_hidden_layers", 0), 0
    layers = tc.get("num_hidden_layers", 0)
    fixed, full, rec = _kda_state(tc, layers)
    if not rec:
        fixed, full, rec = _gated_delta_state(tc, layers)
    if tc.get("kv_lora_rank"):
        indexer = tc.get("index_head_dim", 128) if tc.get("index_topk") else 0  # DSA: every layer keeps its keys
        per_tok = (tc["kv_lora_rank"] + tc.get("qk_rope_head_dim", 0) + indexer) * full
    else:
        heads = tc.get("num_attention_heads", 1)
        hd = tc.get("head_dim") or tc.get("v_head_dim") or tc["hidden_size"] // heads
        per_tok = 2 * tc.get("num_key_value_heads", heads) * hd * full
    return fixed, per_tok, full, rec


def _kda_state(tc: dict, layers: int) -> tuple[int, int, int]:
    """(state bytes, attention layers, KDA layers) of Kimi K3's ``linear_attn_config``."""
    la = tc.get("linear_attn_config") or {}
    full = len(la["full_attn_layers"]) if la.get("full_attn_layers") else layers
    kda = len(la.get("kda_layers", []))
    if not kda:
        return 0, full, 0
    H, K = la["num_heads"], la["head_dim"]
    conv = 3 * (la.get("short_conv_kernel_size", 4) - 1) * H * K
    return kda * (H * K * K + conv) * F32, full, kda


def _gated_delta_state(tc: dict, layers: int) -> tuple[int, int, int]:
    """(state bytes, attention layers, DeltaNet layers) of Qwen3-Next / Qwen3.5: per linear layer the [Hv, dk, dv]
    state and the conv history of q, k, v; ``layer_types`` or, as transformers, every 4th layer full."""
    if "linear_num_value_heads" not in tc:
        return 0, layers, 0
    every = tc.get("full_attention_interval", 4)
    kinds = tc.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                      for i in range(layers)]
    lin = sum(k == "linear_attention" for k in kinds)
    Hk, Hv, dk, dv = (tc.get(f"linear_{n}", d) for n, d in (("num_key_heads", 16), ("num_value_heads", 32),
                                                            ("key_head_dim", 128), ("value_head_dim", 128)))
    conv = (tc.get("linear_conv_kernel_dim", 4) - 1) * (2 * Hk * dk + Hv * dv)
    return lin * (Hv * dk * dv + conv) * F32, layers - lin, lin


def _v4_state(tc: dict) -> tuple[int, float]:
    """DeepSeek-V4's state in values: (fixed per sequence, growing per token). Fixed: each layer's last W-1 keys,
    and per compressor its unfinished window (kv and gate) and CSA's overlap slots. Growing: an entry of d values
    per ``rate`` tokens per compressed layer, CSA's indexer also Di values per 4 tokens."""
    from deltafin.models.deepseek_v4 import CSA, HCA, Config

    c = Config.from_dict(tc)
    d, Di, fixed, per_tok = c.head_dim, c.index_head_dim, 0, 0.0
    for kind in c.layer_types:
        fixed += (c.sliding_window - 1) * d
        if kind == CSA:
            per_tok += (d + Di) / c.csa_rate
            fixed += c.csa_rate * 2 * (2 * d + 2 * Di) + c.csa_rate * 2 * (d + Di)
        elif kind == HCA:
            per_tok += d / c.hca_rate
            fixed += c.hca_rate * 2 * d
    return fixed, per_tok


def context_bytes(tc: dict, tokens: int, value_bytes: int = F32) -> int:
    """One sequence's state at ``tokens`` of context (what stays fixed plus what grows), values of value_bytes."""
    fixed, per_tok, _, _ = state_sizes(tc)
    return int(fixed // F32 * value_bytes + per_tok * tokens * value_bytes)


def sequence_memory(tc: dict, state_dtype_bytes: int = F32) -> dict:
    """Per-sequence state that does not grow (recurrent) and cache bytes per 1k tokens (KV or latent)."""
    fixed, per_tok, full, kda = state_sizes(tc)
    at = {f"state_bytes_{name}{sfx}": context_bytes(tc, n, b) for name, n in (("128k", 131072), ("1m", 1 << 20))
          for sfx, b in (("", state_dtype_bytes), ("_bf16", 2))}
    if tc.get("model_type") == "deepseek_v4":
        return {"recurrent_state_bytes": fixed, "recurrent_layers": 0, **at,
                "cache_kind": f"compressed caches (CSA 1/4 + its indexer, HCA 1/128) beside a window "
                              f"({fixed / 1e6:.1f} MB fixed in float32)",
                "cache_bytes_per_1k_tokens": int(per_tok * 1000 * state_dtype_bytes),
                "cache_bytes_per_1k_tokens_bf16": int(per_tok * 1000 * 2)}
    if tc.get("kv_lora_rank"):
        kind = f"latent cache ({tc['kv_lora_rank']} + {tc.get('qk_rope_head_dim', 0)} values x {full} layers)"
    else:
        kind = f"KV cache ({full} layers)"
    if tc.get("kv_lora_rank") and tc.get("index_topk"):
        kind = kind[:-1] + f", DSA indexer keys {tc.get('index_head_dim', 128)} values per layer)"
    return {"recurrent_state_bytes": fixed, "recurrent_layers": kda, "cache_kind": kind, **at,
            "cache_bytes_per_1k_tokens": per_tok * 1000 * state_dtype_bytes,
            "cache_bytes_per_1k_tokens_bf16": per_tok * 1000 * 2}
