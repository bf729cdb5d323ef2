"""Mixtral (8x7B, 8x22B): GQA attention (optional sliding window), a softmax top-2 router renormalised
over the chosen experts, SwiGLU experts (checkpoint w1/w3/w2 = roles gate/up/down)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltafin.models.base import linear
from deltafin.models.common import READS_GQA, READS_TOP, DecoderConfig, GQADecoder, softmax_topk, take

_ROUTERS = {
    "router": "block_sparse_moe.gate.weight",
    "router_mlp": "mlp.gate.weight",
}  # checkpoint / transformers 5
READS = (  # trunk names the model reads (``store.plan.unused_trunk``): MiniMax-M2's correction bias is not
    *READS_TOP,
    *READS_GQA,
    r"model\.layers\.\d+\.(block_sparse_moe|mlp)\.gate\.weight",
)


@dataclass(frozen=True, slots=True)
class Config(DecoderConfig):
    FAMILY = "mixtral"
    ALIASES = {"num_experts": "num_local_experts"}
    ROPE_THETA = 1e6

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


class Model(GQADecoder):
    """Legend: T tokens, D model width, H query heads, Hkv key/value heads, d head width, k experts per token."""

    OPTIONAL = (*GQADecoder.OPTIONAL, *_ROUTERS)

    def _layer_names(self, i: int) -> dict[str, str]:
        return _ROUTERS

    def _setup(self) -> None:
        super()._setup()
        for i, lw in enumerate(
            self.layers
        ):  # one of the two names; take() names the first when neither is there
            if lw["router"] is None:
                lw["router"] = lw["router_mlp"]
            if lw["router"] is None:
                take(self.w, f"model.layers.{i}.", {"router": _ROUTERS["router"]})

    def _router_one(self, i: int) -> tuple:
        return self.layers[i]["router"], self.cfg.num_experts_per_tok, True

    def _router(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x, self.layers[i]["router"])  # [T, E]
        return softmax_topk(logits, self.cfg.num_experts_per_tok, renormalize=True)
