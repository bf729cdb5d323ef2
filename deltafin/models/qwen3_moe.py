"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA attention with per-head q/k RMSNorm, a softmax top-k
router renormalised when ``norm_topk_prob``, SwiGLU experts. Layers in ``mlp_only_layers`` or off the
``decoder_sparse_step`` grid have a dense SwiGLU MLP instead."""

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

_MOE = {"router": "mlp.gate.weight"}
_DENSE = {"gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"}
READS = (  # trunk names the model reads (``store.plan.unused_trunk``)
    *READS_TOP,
    *READS_GQA,
    *READS_QK_NORM,
    r"model\.layers\.\d+\.mlp\.(gate|gate_proj|up_proj|down_proj)\.weight",
)


@dataclass(frozen=True, slots=True)
class Config(DecoderConfig):
    FAMILY = "qwen3_moe"
    ALIASES = {"num_local_experts": "num_experts"}  # transformers 5's name

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

    @classmethod
    def _extra(cls, d: dict) -> dict:
        return {
            "mlp_only_layers": tuple(d.get("mlp_only_layers") or ()),
            "sliding_window": d.get("sliding_window") if d.get("use_sliding_window") else None,
        }

    def is_moe(self, i: int) -> bool:
        return (
            i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0
        )


class Model(GQADecoder):
    """Legend: T tokens, D model width, H query heads, Hkv key/value heads, d head width, k experts per token."""

    def _layer_names(self, i: int) -> dict[str, str]:
        return QK_NORMS | (_MOE if self.cfg.is_moe(i) else _DENSE)

    def _qkv(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super()._qkv(i, h)
        lw, T, d, eps = self.layers[i], h.shape[0], self.cfg.head_dim, self.norm_eps
        return (
            rms_norm(q.view(T, -1, d), lw["qn"], eps),
            rms_norm(k.view(T, -1, d), lw["kn"], eps),
            v,
        )  # per head

    def _qk_norms(self, i: int) -> tuple:
        return self.layers[i]["qn"], self.layers[i]["kn"]

    def _is_moe(self, i: int) -> bool:
        return self.cfg.is_moe(i)

    def _router_one(self, i: int) -> tuple:
        return self.layers[i]["router"], self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob

    def _router(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x, self.layers[i]["router"])  # [T, E]
        return softmax_topk(logits, self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob)
