"""MiniMax-M2 / M2.1 / M2.5 (``minimax_m2``): GQA whose q and k are RMS-normed over all heads at once (one
weight of H*d and one of Hkv*d), partial RoPE (``rotary_dim`` of each head, rotated halves), a sigmoid router
whose correction bias (``block_sparse_moe.e_score_correction_bias``) only picks the experts, no groups, the
chosen scores renormalised; Mixtral-style experts (w1/w3/w2 = gate/up/down), no shared expert."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltafin.models.base import linear, rms_norm
from deltafin.models.common import (
    READS_QK_NORM,
    READS_TOP,
    DecoderConfig,
    GQADecoder,
    config_kwargs,
    sigmoid_topk,
)
from deltafin.models.rope import rope_parameters

_LAYER = {
    "qn": "self_attn.q_norm.weight",
    "kn": "self_attn.k_norm.weight",
    "router": "block_sparse_moe.gate.weight",
    "bias": "block_sparse_moe.e_score_correction_bias",
}

READS = (
    *READS_TOP,
    r"model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj\.weight",
    *READS_QK_NORM,
    r"model\.layers\.\d+\.block_sparse_moe\.(gate\.weight|e_score_correction_bias)",
)


@dataclass(frozen=True, slots=True)
class Config(DecoderConfig):
    FAMILY = "minimax_m2"
    ALIASES = {"num_experts": "num_local_experts"}
    ROPE_THETA = 5e6

    vocab_size: int = 200064
    hidden_size: int = 3072
    intermediate_size: int = 1536  # one routed expert
    num_hidden_layers: int = 62
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int | None = 128
    num_local_experts: int = 256
    num_experts_per_tok: int = 8
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 196608
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 5e6})

    @classmethod
    def from_dict(cls, d):
        """From a config.json dict; unknown keys are ignored. The released ``rotary_dim`` is the partial RoPE."""
        kw = config_kwargs(cls, d, aliases=cls.ALIASES)
        rope = rope_parameters(d, cls.ROPE_THETA)
        head_dim = kw.get("head_dim") or 128
        if d.get("rotary_dim") is not None:
            rope.setdefault("partial_rotary_factor", d["rotary_dim"] / head_dim)
        return cls(**kw, rope=rope)


class Model(GQADecoder):
    """Legend: T tokens, D model width, H query heads, Hkv key/value heads, d head width, k experts per token."""

    def _layer_names(self, i: int) -> dict[str, str]:
        return _LAYER

    def _qkv(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super()._qkv(i, h)
        lw, eps = self.layers[i], self.norm_eps
        return rms_norm(q, lw["qn"], eps), rms_norm(k, lw["kn"], eps), v  # [T, H*d], [T, Hkv*d]: all heads at once

    def _router(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lw = self.layers[i]
        logits = linear(x, lw["router"]).float()  # [T, E]
        return sigmoid_topk(logits, lw["bias"], self.cfg.num_experts_per_tok, True, 1.0)
