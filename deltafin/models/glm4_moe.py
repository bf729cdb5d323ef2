"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air (``glm4_moe``): GQA with partial RoPE (rotated halves over the first
``partial_rotary_factor`` of each head, 0.5 unless the config says otherwise), optional per-head QK-norm and
q/k/v biases, the DeepSeek-V3 sigmoid router (selection-only correction bias, groups, renormalisation, routed
scaling factor), one shared expert added unweighted, dense first layers. The MTP layers past
``num_hidden_layers`` are skipped at pack time."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltafin.errors import UnsupportedArchitectureError
from deltafin.models.base import linear, rms_norm
from deltafin.models.common import (
    QK_NORMS,
    READS_QK_NORM,
    READS_TOP,
    DecoderConfig,
    GQADecoder,
    config_kwargs,
    sigmoid_topk,
)
from deltafin.models.rope import rope_parameters

_MOE = {"router": "mlp.gate.weight", "bias": "mlp.gate.e_score_correction_bias"}
_DENSE = {"gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"}

# trunk names the model reads (after ``model.layers.N.``); pack refuses others (``plan.unused_trunk``)
READS = (
    *READS_TOP,
    r"model\.layers\.\d+\.self_attn\.(q|k|v)_proj\.(weight|bias)",
    r"model\.layers\.\d+\.self_attn\.o_proj\.weight",
    *READS_QK_NORM,
    r"model\.layers\.\d+\.mlp\.(shared_experts\.)?(gate|up|down)_proj\.weight",
    r"model\.layers\.\d+\.mlp\.gate\.(weight|e_score_correction_bias)",
)


@dataclass(frozen=True, slots=True)
class Config(DecoderConfig):
    FAMILY = "glm4_moe"
    ALIASES = {"num_local_experts": "n_routed_experts"}

    vocab_size: int = 151552
    hidden_size: int = 4096
    intermediate_size: int = 10944  # dense layers
    moe_intermediate_size: int = 1408
    num_hidden_layers: int = 46
    num_attention_heads: int = 96
    num_key_value_heads: int = 8
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    n_routed_experts: int = 128
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    use_qk_norm: bool = False
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})

    def __post_init__(self) -> None:
        DecoderConfig.__post_init__(self)  # (a slotted dataclass: no zero-argument super)
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            raise UnsupportedArchitectureError(
                f"glm4_moe: {self.n_routed_experts} experts cannot form {self.n_group} groups keeping {self.topk_group}"
            )

    @classmethod
    def from_dict(cls, d):
        """From a config.json dict; unknown keys are ignored. Partial RoPE is 0.5 unless set (as transformers)."""
        rope = rope_parameters(d, cls.ROPE_THETA)
        rope.setdefault("partial_rotary_factor", 0.5)
        return cls(**config_kwargs(cls, d, aliases=cls.ALIASES), rope=rope)

    def is_moe(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and self.n_routed_experts > 0


class Model(GQADecoder):
    """Legend: T tokens, D model width, H query heads, Hkv key/value heads, d head width, k experts per token."""

    def _layer_names(self, i: int) -> dict[str, str]:
        norms = QK_NORMS if self.cfg.use_qk_norm else {}
        return norms | (_MOE if self.cfg.is_moe(i) else _DENSE)

    def _qkv(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super()._qkv(i, h)
        if not self.cfg.use_qk_norm:
            return q, k, v
        lw, T, d, eps = self.layers[i], h.shape[0], self.cfg.head_dim, self.norm_eps
        return rms_norm(q.view(T, -1, d), lw["qn"], eps), rms_norm(k.view(T, -1, d), lw["kn"], eps), v

    def _qk_norms(self, i: int) -> tuple:
        return (self.layers[i]["qn"], self.layers[i]["kn"]) if self.cfg.use_qk_norm else (None, None)

    def _is_moe(self, i: int) -> bool:
        return self.cfg.is_moe(i)

    def _moe_side(self, i: int, x: torch.Tensor) -> torch.Tensor | None:
        return self._swiglu(i, "mlp.shared_experts.", x) if self.cfg.n_shared_experts else None

    def _router(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmoid over float32 logits, group-limited top-k picked with the bias; weights include the scaling."""
        c, lw = self.cfg, self.layers[i]
        logits = linear(x.float(), lw["router"])  # [T, E] fp32
        return sigmoid_topk(logits, lw["bias"], c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor,
                            c.n_group, c.topk_group)
