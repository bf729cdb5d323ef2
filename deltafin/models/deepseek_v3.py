"""DeepSeek-V3 family: DeepSeek-V3/R1, Kimi K2 (``kimi_k2``) and GLM-4.7-Flash (``glm4_moe_lite``).

MLA attention over a latent cache (``mla.py``), YaRN RoPE with mscale in the softmax scale, and a
sigmoid router with a selection-only bias, group-limited top-k, optional renormalisation and a routed
scaling factor; shared experts are added unweighted; the first layers are dense. Trunk weights keep
their checkpoint names (``model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight``...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltafin.errors import UnsupportedArchitectureError
from deltafin.models import mla
from deltafin.models.base import SequenceState, linear
from deltafin.models.common import (
    READS_TOP,
    DecoderLM,
    config_kwargs,
    require_keys,
    require_tensors,
    settle_decoder_config,
    sigmoid_topk,
)
from deltafin.models.layers import GrowingCache
from deltafin.models.rope import Rope, RopeConfig, apply_rope, yarn_mscale

MODEL_TYPES = ("deepseek_v3", "kimi_k2", "glm4_moe_lite")
REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
# transformers' defaults where GLM-4.7-Flash differs from DeepSeek-V3
GLM_DEFAULTS = dict(
    n_group=1, topk_group=1, routed_scaling_factor=1.8, rms_norm_eps=1e-5, first_k_dense_replace=1
)
# trunk names the model reads; pack refuses a checkpoint with others (``store.plan.unused_trunk``): the DSA
# indexer of DeepSeek-V3.2 (``self_attn.indexer.*``) is not read here
READS = (
    *READS_TOP,
    r"model\.layers\.\d+\.self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)\.(weight|bias)",
    r"model\.layers\.\d+\.self_attn\.(q_a_layernorm|kv_a_layernorm)\.weight",
    r"model\.layers\.\d+\.mlp\.(shared_experts\.)?(gate|up|down)_proj\.weight",
    r"model\.layers\.\d+\.mlp\.gate\.(weight|e_score_correction_bias)",
)


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int  # dense layers
    moe_intermediate_size: int  # one routed expert; shared experts are n_shared_experts times wider
    n_routed_experts: int
    num_experts_per_tok: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeConfig
    q_lora_rank: int | None = 1536
    n_shared_experts: int = 1
    n_group: int = 8
    topk_group: int = 4
    first_k_dense_replace: int = 3
    mlp_layer_types: tuple[str, ...] | None = None  # glm4_moe_lite: "dense" | "sparse" per layer
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    scoring_func: str = "sigmoid"
    hidden_act: str = "silu"
    model_type: str = "deepseek_v3"

    SERVES = MODEL_TYPES  # the model types this config class reads (deepseek_v32.py: its own)

    def __post_init__(self) -> None:
        if self.model_type not in self.SERVES:
            raise UnsupportedArchitectureError(
                f"model_type {self.model_type!r} is not served by {type(self).__module__}; "
                f"it serves {', '.join(self.SERVES)}"
            )
        if self.scoring_func != "sigmoid":
            raise UnsupportedArchitectureError(
                f"{self.model_type}: scoring_func {self.scoring_func!r}; only sigmoid routing (DeepSeek-V3 style) "
                f"is supported"
            )
        settle_decoder_config(self, self.model_type)
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            raise UnsupportedArchitectureError(
                f"{self.n_routed_experts} experts cannot form {self.n_group} groups keeping {self.topk_group}"
            )
        if self.rope.dim != self.qk_rope_head_dim:
            raise UnsupportedArchitectureError(
                f"rotary width {self.rope.dim} != qk_rope_head_dim {self.qk_rope_head_dim} (partial_rotary_factor "
                f"must be 1 for MLA)"
            )

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        """From a config.json dict; unknown keys are ignored."""
        require_keys(d, REQUIRED, "DeepSeek-V3-family")
        kw = dict(GLM_DEFAULTS) if d.get("model_type") == "glm4_moe_lite" else {}
        kw.update(config_kwargs(cls, d, exclude=("rope", "mlp_layer_types", "q_lora_rank")))
        if "q_lora_rank" in d:
            kw["q_lora_rank"] = d["q_lora_rank"]  # None: a plain q_proj (DeepSeek-V2-Lite style)
        if d.get("mlp_layer_types"):
            kw["mlp_layer_types"] = tuple(d["mlp_layer_types"])
        kw["rope"] = RopeConfig.from_config(d, int(d["qk_rope_head_dim"]))
        return cls(**kw)

    def is_moe(self, i: int) -> bool:
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[i] == "sparse"
        return i >= self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.rope.kind != "default" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)  # YaRN: mscale^2 on the logits
            scale = scale * m * m
        return scale


class Model(DecoderLM):
    """DeepSeek-V3-family decoder driven layer by layer (see ``deltafin.models.base``)."""

    def _setup(self) -> None:
        c = self.cfg
        names = [
            "self_attn.kv_a_proj_with_mqa.weight",
            "self_attn.kv_b_proj.weight",
            "self_attn.o_proj.weight",
        ]
        require_tensors(
            self.w,
            [
                f"model.layers.{i}.{n}"
                for i in range(self.num_layers)
                for n in [*names, "mlp.gate.weight" if c.is_moe(i) else "mlp.gate_proj.weight"]
            ],
        )
        self.rope = Rope(c.rope, device=self.device)
        self.mla_mode = "auto"  # "auto" | "absorb" | "expand": how attention reads the latent cache

    def new_layer_state(self, i: int, max_len: int) -> GrowingCache:
        width = self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim  # latent + rotated key, per token
        return GrowingCache((width,), max_len, self.device, self.dtype)

    def _attention(self, i: int, h: torch.Tensor, state: SequenceState) -> torch.Tensor:
        c, (T, _), pos = self.cfg, h.shape, state.pos
        H, dn, r, R = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        p = self.w.get
        pre = f"model.layers.{i}.self_attn."
        q, latent, k_pe = mla.project(h, lambda n: p(pre + n), H, dn, r, R, c.q_lora_rank is not None)
        cos, sin = self.rope.cos_sin(pos, T)  # [T, r/2]
        q_rot = apply_rope(q[..., dn:], cos, sin, c.rope_interleave)  # [T, H, r]
        k_rot = apply_rope(k_pe, cos, sin, c.rope_interleave)  # [T, r]
        rows = state.layers[i].write(pos, torch.cat((latent, k_rot), dim=-1))  # [S, R+r]
        attend = mla.attend_absorbed if self._absorb(T, pos + T) else mla.attend_expanded
        w_kv_b = p(pre + "kv_b_proj.weight")  # [H*(dn+dv), R]
        o = attend(q[..., :dn], q_rot, rows, w_kv_b, dn, c.v_head_dim, c.softmax_scale, pos)  # [T, H*dv]
        return linear(o, p(pre + "o_proj.weight"), p(pre + "o_proj.bias"))

    def _absorb(self, T: int, S: int) -> bool:
        if self.mla_mode != "auto":
            return self.mla_mode == "absorb"
        c = self.cfg
        return mla.absorb_is_better(
            T, S, c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
        )

    def _is_moe(self, i: int) -> bool:
        return self.cfg.is_moe(i)

    def _moe_side(self, i: int, x: torch.Tensor) -> torch.Tensor | None:
        return self._swiglu(i, "mlp.shared_experts.", x) if self.cfg.n_shared_experts else None

    def _router(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmoid, group-limited top-k; weights include routed_scaling_factor."""
        c = self.cfg
        logits = linear(x.float(), self._p(i, "mlp.gate.weight"))  # [T, E] fp32
        bias = self._p(i, "mlp.gate.e_score_correction_bias")
        k, scaling = c.num_experts_per_tok, c.routed_scaling_factor
        return sigmoid_topk(logits, bias, k, c.norm_topk_prob, scaling, c.n_group, c.topk_group)
