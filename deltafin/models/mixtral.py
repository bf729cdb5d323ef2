"""Mixtral (8x7B, 8x22B): GQA attention (optional sliding window), a softmax top-2 router renormalised
over the chosen experts, SwiGLU experts (checkpoint w1/w3/w2 = roles gate/up/down)."""

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
    "router": "block_sparse_moe.gate.weight",
    "router_mlp": "mlp.gate.weight",  # checkpoint / transformers 5 name
}


@dataclass(frozen=True, slots=True)
class Config:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6})

    def __post_init__(self) -> None:
        settle_decoder_config(self, "mixtral")

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        kw = config_kwargs(cls, d, aliases={"num_experts": "num_local_experts"})
        kw["rope"] = rope_parameters(d, 1e6)
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
        self.layers = [self._layer(i) for i in range(cfg.num_hidden_layers)]

    def _layer(self, i: int) -> dict:
        p = f"model.layers.{i}."
        lw = take(self.w, p, _LAYER, optional=("router", "router_mlp"))
        alt = lw.pop("router_mlp")
        if lw["router"] is None:  # take() raises, naming the checkpoint name, when neither is there
            lw["router"] = alt if alt is not None else take(self.w, p, {"router": _LAYER["router"]})["router"]
        return lw

    def new_layer_state(self, i: int, max_len: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_key_value_heads, c.head_dim, c.head_dim, max_len, self.device, self.dtype)

    def attn_part(self, i: int, carry: torch.Tensor, state: SequenceState) -> torch.Tensor:
        c, lw = self.cfg, self.layers[i]
        T, _ = carry.shape
        h = rms_norm(carry, lw["ln1"], c.rms_norm_eps)  # [T, D]
        q = linear(h, lw["q"]).view(T, c.num_attention_heads, c.head_dim)  # [T, H, d]
        k = linear(h, lw["k"]).view(T, c.num_key_value_heads, c.head_dim)  # [T, Hkv, d]
        v = linear(h, lw["v"]).view(T, c.num_key_value_heads, c.head_dim)  # [T, Hkv, d]
        o = self_attention(
            q, k, v, self.rope, state.layers[i], state.pos, self.scale, c.sliding_window
        )  # [T, H*d]
        return carry + linear(o, lw["o"])

    def mlp_part(self, i: int, carry: torch.Tensor, experts: ExpertSource) -> torch.Tensor:
        h = rms_norm(carry, self.layers[i]["ln2"], self.cfg.rms_norm_eps)  # [T, D]
        ids, weights = self._route(i, h)  # [T, k]
        return carry + moe_dispatch(h, ids, weights, i, experts, swiglu_expert)

    def route(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts of layer i for a carry x [T, D] (the input of ``mlp_part``; the norm is applied here):
        (ids [T, k] long, weights [T, k] float32). Every Mixtral layer is MoE."""
        return self._route(i, rms_norm(x, self.layers[i]["ln2"], self.cfg.rms_norm_eps))

    def _route(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(h, self.layers[i]["router"])  # [T, E]
        return softmax_topk(logits, self.cfg.num_experts_per_tok, renormalize=True)
