"""OLMoE (OLMoE-1B-7B): attention with q/k RMSNorm over the full projection width (before the head split)
and optional ``clip_qkv``, a softmax top-k router (renormalised only when ``norm_topk_prob``), SwiGLU experts."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltafin.models.base import linear, rms_norm
from deltafin.models.common import (
    QK_NORMS,
    READS_GQA,
    READS_QK_NORM,
    READS_TOP,
    DecoderConfig,
    GQADecoder,
    softmax_topk,
)

READS = (  # trunk names the model reads (``store.plan.unused_trunk``)
    *READS_TOP,
    *READS_GQA,
    *READS_QK_NORM,
    r"model\.layers\.\d+\.mlp\.gate\.weight",
)


@dataclass(frozen=True, slots=True)
class Config(DecoderConfig):
    FAMILY = "olmoe"
    ALIASES = {"num_local_experts": "num_experts"}

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


class Model(GQADecoder):
    """Legend: T tokens, D model width, H query heads, Hkv key/value heads, d head width, k experts per token."""

    def _layer_names(self, i: int) -> dict[str, str]:
        return QK_NORMS | {"router": "mlp.gate.weight"}

    def _qkv(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super()._qkv(i, h)  # [T, H*d], [T, Hkv*d], [T, Hkv*d]
        lw, c = self.layers[i], self.cfg
        q, k = (
            rms_norm(q, lw["qn"], self.norm_eps),
            rms_norm(k, lw["kn"], self.norm_eps),
        )  # over the full width
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        return q, k, v

    def _router_one(self, i: int) -> tuple:
        return self.layers[i]["router"], self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob

    def _router(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x, self.layers[i]["router"])  # [T, E]
        return softmax_topk(logits, self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob)
