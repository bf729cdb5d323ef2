"""OLMoE (OLMoE-1B-7B): attention with q/k RMSNorm over the full projection width (before the head split)
and optional ``clip_qkv``, a softmax top-k router (renormalised only when ``norm_topk_prob``), SwiGLU experts."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltafin.models.base import ExpertSource, SequenceState, Weights, linear, moe_dispatch, rms_norm
from deltafin.models.common import (
    DecoderLM,
    config_kwargs,
    settle_decoder_config,
    softmax_topk,
    swiglu_expert,
    take,
)
from deltafin.models.layers import KVCache, self_attention
from deltafin.models.rope import Rope, rope_parameters

_LAYER = {
    "ln1": "input_layernorm.weight",
    "ln2": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "qn": "self_attn.q_norm.weight",
    "kn": "self_attn.k_norm.weight",
    "q_b": "self_attn.q_proj.bias",
    "k_b": "self_attn.k_proj.bias",
    "v_b": "self_attn.v_proj.bias",
    "o_b": "self_attn.o_proj.bias",
    "router": "mlp.gate.weight",
}
_BIASES = ("q_b", "k_b", "v_b", "o_b")


@dataclass(frozen=True, slots=True)
class Config:
    vocab_size: int = 50304
    hidden_size: int = 2048
    intermediate_size: int = 2048
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None  # None: num_attention_heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    num_experts: int = 64
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    clip_qkv: float | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})

    def __post_init__(self) -> None:
        settle_decoder_config(self, "olmoe")

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        kw = config_kwargs(cls, d, aliases={"num_local_experts": "num_experts"})
        kw["rope"] = rope_parameters(d, 10000.0)
        return cls(**kw)


class Model(DecoderLM):
    """Legend: T tokens, D model width, H query heads, Hkv key/value heads, d head width, k experts per token."""

    def __init__(
        self,
        cfg: Config,
        weights: Weights,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__(weights, device, dtype, cfg.rms_norm_eps, cfg.tie_word_embeddings)
        self.cfg = cfg
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = cfg.vocab_size
        self.rope = Rope(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, self.device)
        self.scale = cfg.head_dim**-0.5
        self.layers = [
            take(self.w, f"model.layers.{i}.", _LAYER, optional=_BIASES) for i in range(self.num_layers)
        ]

    def new_layer_state(self, i: int, max_len: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_key_value_heads, c.head_dim, c.head_dim, max_len, self.device, self.dtype)

    def _qkv(self, lw: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c, eps = self.cfg, self.cfg.rms_norm_eps
        q = rms_norm(linear(h, lw["q"], lw["q_b"]), lw["qn"], eps)  # [T, H*d], normed over the full width
        k = rms_norm(linear(h, lw["k"], lw["k_b"]), lw["kn"], eps)  # [T, Hkv*d]
        v = linear(h, lw["v"], lw["v_b"])  # [T, Hkv*d]
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        return q, k, v

    def attn_part(self, i: int, carry: torch.Tensor, state: SequenceState) -> torch.Tensor:
        c, lw = self.cfg, self.layers[i]
        T, _ = carry.shape
        h = rms_norm(carry, lw["ln1"], c.rms_norm_eps)  # [T, D]
        q, k, v = self._qkv(lw, h)
        q = q.view(T, c.num_attention_heads, c.head_dim)  # [T, H, d]
        k = k.view(T, c.num_key_value_heads, c.head_dim)  # [T, Hkv, d]
        v = v.view(T, c.num_key_value_heads, c.head_dim)  # [T, Hkv, d]
        o = self_attention(q, k, v, self.rope, state.layers[i], state.pos, self.scale)  # [T, H*d]
        return carry + linear(o, lw["o"], lw["o_b"])

    def mlp_part(self, i: int, carry: torch.Tensor, experts: ExpertSource) -> torch.Tensor:
        h = rms_norm(carry, self.layers[i]["ln2"], self.cfg.rms_norm_eps)  # [T, D]
        ids, weights = self._route(i, h)  # [T, k]
        return carry + moe_dispatch(h, ids, weights, i, experts, swiglu_expert)

    def route(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts of layer i for a carry x [T, D] (the input of ``mlp_part``; the norm is applied here):
        (ids [T, k] long, weights [T, k] float32). Every OLMoE layer is MoE."""
        return self._route(i, rms_norm(x, self.layers[i]["ln2"], self.cfg.rms_norm_eps))

    def _route(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(h, self.layers[i]["router"])  # [T, E]
        return softmax_topk(logits, self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob)
