"""DeepSeek-V3 family: DeepSeek-V3/R1, Kimi K2 (``kimi_k2``) and GLM-4.7-Flash (``glm4_moe_lite``).

MLA attention over a latent cache (``mla.py``), YaRN RoPE with mscale in the softmax scale, and a
sigmoid router with a selection-only bias, group-limited top-k, optional renormalisation and a routed
scaling factor; shared experts are added unweighted; the first layers are dense. Trunk weights keep
their checkpoint names (``model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight``...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltafin.errors import CheckpointError, UnsupportedArchitectureError
from deltafin.models import mla
from deltafin.models.base import (
    ExpertSource,
    ExpertTensors,
    SequenceState,
    Weights,
    dense,
    embed_rows,
    linear,
    moe_dispatch,
    rms_norm,
)
from deltafin.models.common import config_kwargs, require_keys, settle_decoder_config
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

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"model_type {self.model_type!r} is not served by deepseek_v3.py; "
                f"it serves {', '.join(MODEL_TYPES)}"
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


def swiglu(x: torch.Tensor, gate, up, down) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for x [n, D]."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def routed_expert(x: torch.Tensor, t: ExpertTensors) -> torch.Tensor:
    return swiglu(x, t["gate"], t["up"], t["down"])


class Model:
    """DeepSeek-V3-family decoder driven layer by layer (see ``deltafin.models.base``)."""

    def __init__(
        self,
        cfg: Config,
        weights: Weights,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.num_layers, self.vocab_size = cfg.num_hidden_layers, cfg.vocab_size
        _check_weights(cfg, weights)
        self.w = {n: t.to(self.device) for n, t in weights.items()}
        self.rope = Rope(cfg.rope, device=self.device)
        self.mla_mode = "auto"  # "auto" | "absorb" | "expand": how attention reads the latent cache

    def _p(self, i: int, name: str):
        return self.w.get(f"model.layers.{i}.{name}")

    def new_state(self, max_len: int) -> SequenceState:
        width = self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim  # latent + rotated key, per token
        return SequenceState(
            [GrowingCache((width,), max_len, self.device, self.dtype) for _ in range(self.num_layers)]
        )

    def embed(self, ids: torch.LongTensor) -> torch.Tensor:
        return embed_rows(self.w["model.embed_tokens.weight"], ids.to(self.device), self.dtype)  # [T, D]

    def attn_part(self, i: int, carry: torch.Tensor, state: SequenceState) -> torch.Tensor:
        h = rms_norm(carry, self._p(i, "input_layernorm.weight"), self.cfg.rms_norm_eps)
        return carry + self._attention(i, h, state)

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

    def mlp_part(self, i: int, carry: torch.Tensor, experts: ExpertSource) -> torch.Tensor:
        h = rms_norm(carry, self._p(i, "post_attention_layernorm.weight"), self.cfg.rms_norm_eps)
        if not self.cfg.is_moe(i):
            return carry + self._mlp(i, "mlp.", h)
        ids, weights = self.route(i, h)
        y = moe_dispatch(h, ids, weights, i, experts, routed_expert)  # [T, D]
        if self.cfg.n_shared_experts:
            y = y + self._mlp(i, "mlp.shared_experts.", h)
        return carry + y

    def _mlp(self, i: int, prefix: str, h: torch.Tensor) -> torch.Tensor:
        return swiglu(h, *(self._p(i, f"{prefix}{n}_proj.weight") for n in ("gate", "up", "down")))

    def route(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Experts [T, k] and their weights [T, k] (float32, routed_scaling_factor included) for x [T, D],
        the MoE input (after post_attention_layernorm); None for dense layers."""
        if not self.cfg.is_moe(i):
            return None
        c = self.cfg
        scores = linear(x.float(), self._p(i, "mlp.gate.weight")).sigmoid()  # [T, E] fp32
        bias = self._p(i, "mlp.gate.e_score_correction_bias")
        choice = scores if bias is None else scores + dense(bias, torch.float32)  # selection only
        ids = _group_limited(choice, c.n_group, c.topk_group).topk(c.num_experts_per_tok, dim=-1).indices
        w = scores.gather(1, ids)  # [T, k]
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * c.routed_scaling_factor

    def head(self, carry: torch.Tensor) -> torch.Tensor:
        h = rms_norm(carry, self.w["model.norm.weight"], self.cfg.rms_norm_eps)
        return linear(h, self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])).float()  # [T, V]

    def forward(self, ids: torch.LongTensor, state: SequenceState, experts: ExpertSource) -> torch.Tensor:
        x = self.embed(ids)
        for i in range(self.num_layers):
            x = self.mlp_part(i, self.attn_part(i, x, state), experts)
        state.pos += ids.shape[0]
        return self.head(x)


def _group_limited(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """choice [T, E] with experts outside the best topk_group groups set to -inf; a group's score is
    the sum of its two best experts."""
    if topk_group >= n_group:
        return choice
    T, E = choice.shape
    per = E // n_group
    groups = choice.view(T, n_group, per).topk(min(2, per), dim=-1).values.sum(-1)  # [T, G]
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(1, groups.topk(topk_group, dim=-1).indices, True)
    return choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))


def _check_weights(cfg: Config, weights: Weights) -> None:
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        need += [
            p + "self_attn.kv_a_proj_with_mqa.weight",
            p + "self_attn.kv_b_proj.weight",
            p + "self_attn.o_proj.weight",
        ]
        need += [p + ("mlp.gate.weight" if cfg.is_moe(i) else "mlp.gate_proj.weight")]
    missing = [n for n in need if n not in weights]
    if missing:
        raise CheckpointError(
            f"trunk lacks {len(missing)} tensor(s) the config needs, e.g. {missing[:3]}; "
            f"was this model packed from a different checkpoint?"
        )
