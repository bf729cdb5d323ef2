"""Mixtral (8x7B, 8x22B): GQA attention (optional sliding window), a softmax top-2 router renormalised
over the chosen experts, SwiGLU experts (checkpoint w1/w3/w2 = roles gate/up/down)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltafin.models.base import linear
from deltafin.models.common import GQADecoder, config_kwargs, settle_decoder_config, softmax_topk, take
from deltafin.models.rope import rope_parameters

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


class Model(GQADecoder):
    """Legend: T tokens, D model width, H query heads, Hkv key/value heads, d head width, k experts per token."""

    def _setup(self) -> None:
        super()._setup()
        self.routers = [self._router_weight(f"model.layers.{i}.") for i in range(self.num_layers)]

    def _router_weight(self, p: str):
        lw = take(self.w, p, _LAYER, optional=("router", "router_mlp"))
        if lw["router"] is not None:
            return lw["router"]
        if lw["router_mlp"] is not None:
            return lw["router_mlp"]
        return take(self.w, p, {"router": _LAYER["router"]})["router"]  # raises, naming the checkpoint name

    def _router(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x, self.routers[i])  # [T, E]
        return softmax_topk(logits, self.cfg.num_experts_per_tok, renormalize=True)
