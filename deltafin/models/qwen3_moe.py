"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA attention with per-head q/k RMSNorm, a softmax top-k
router renormalised when ``norm_topk_prob``, SwiGLU experts. Layers in ``mlp_only_layers`` or off the
``decoder_sparse_step`` grid have a dense SwiGLU MLP instead."""

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

_ATTN = {
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
}
_BIASES = ("q_b", "k_b", "v_b", "o_b")
_MOE = {"router": "mlp.gate.weight"}
_DENSE = {"gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"}


@dataclass(frozen=True, slots=True)
class Config:
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144  # dense layers
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    sliding_window: int | None = None  # only when use_sliding_window
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})

    def __post_init__(self) -> None:
        settle_decoder_config(self, "qwen3_moe")

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        kw = config_kwargs(cls, d, aliases={"num_local_experts": "num_experts"})  # transformers 5's name
        kw["mlp_only_layers"] = tuple(d.get("mlp_only_layers") or ())
        kw["sliding_window"] = d.get("sliding_window") if d.get("use_sliding_window") else None
        kw["rope"] = rope_parameters(d, 10000.0)
        return cls(**kw)

    def is_moe(self, i: int) -> bool:
        return (
            i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0
        )


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
        self.layers = [self._layer(i) for i in range(cfg.num_hidden_layers)]

    def _layer(self, i: int) -> dict:
        return take(
            self.w, f"model.layers.{i}.", _ATTN | (_MOE if self.cfg.is_moe(i) else _DENSE), optional=_BIASES
        )

    def new_layer_state(self, i: int, max_len: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_key_value_heads, c.head_dim, c.head_dim, max_len, self.device, self.dtype)

    def attn_part(self, i: int, carry: torch.Tensor, state: SequenceState) -> torch.Tensor:
        c, lw, eps = self.cfg, self.layers[i], self.cfg.rms_norm_eps
        T, _ = carry.shape
        h = rms_norm(carry, lw["ln1"], eps)  # [T, D]
        q = linear(h, lw["q"], lw["q_b"]).view(T, c.num_attention_heads, c.head_dim)  # [T, H, d]
        k = linear(h, lw["k"], lw["k_b"]).view(T, c.num_key_value_heads, c.head_dim)  # [T, Hkv, d]
        v = linear(h, lw["v"], lw["v_b"]).view(T, c.num_key_value_heads, c.head_dim)  # [T, Hkv, d]
        q, k = rms_norm(q, lw["qn"], eps), rms_norm(k, lw["kn"], eps)  # per head, over d
        o = self_attention(
            q, k, v, self.rope, state.layers[i], state.pos, self.scale, c.sliding_window
        )  # [T, H*d]
        return carry + linear(o, lw["o"], lw["o_b"])

    def mlp_part(self, i: int, carry: torch.Tensor, experts: ExpertSource) -> torch.Tensor:
        lw = self.layers[i]
        h = rms_norm(carry, lw["ln2"], self.cfg.rms_norm_eps)  # [T, D]
        if "router" not in lw:
            return carry + swiglu_expert(h, lw)
        ids, weights = self._route(lw, h)  # [T, k]
        return carry + moe_dispatch(h, ids, weights, i, experts, swiglu_expert)

    def route(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Experts of layer i for a carry x [T, D] (the input of ``mlp_part``; the norm is applied here):
        (ids [T, k] long, weights [T, k] float32), or None for a dense layer."""
        lw = self.layers[i]
        if "router" not in lw:
            return None
        return self._route(lw, rms_norm(x, lw["ln2"], self.cfg.rms_norm_eps))

    def _route(self, lw: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(h, lw["router"])  # [T, E]
        return softmax_topk(logits, self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob)
