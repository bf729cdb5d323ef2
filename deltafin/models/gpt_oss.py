"""gpt-oss (20b / 120b): GQA attention with learned per-head sinks and q/k/v/o biases, a sliding window
on the layers ``layer_types`` marks ``sliding_attention``, YaRN RoPE, a biased linear router (top-k, then
softmax over the chosen), and experts with an interleaved gate/up and a clamped SwiGLU.

Expert roles: ``gate_up`` [2I, H] whose rows alternate gate/up, ``gate_up_bias`` [2I], ``down`` [H, I],
``down_bias`` [H]. Trunk weights keep their checkpoint names (``model.layers.{i}.self_attn.sinks``...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltafin.errors import CheckpointError
from deltafin.models.base import ExpertTensors, dense, linear
from deltafin.models.common import (
    READS_GQA,
    READS_TOP,
    GQADecoder,
    config_kwargs,
    require_keys,
    settle_decoder_config,
)
from deltafin.models.layers import KVCache
from deltafin.models.rope import RopeConfig

REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# gpt-oss' RoPE when the config names none (transformers' GptOssConfig defaults)
ROPE_DEFAULTS = dict(
    rope_type="yarn",
    factor=32.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=4096,
)
ALIASES = {"num_experts": "num_local_experts", "experts_per_token": "num_experts_per_tok"}
READS = (  # trunk names the model reads (``store.plan.unused_trunk``)
    *READS_TOP,
    *READS_GQA,
    r"model\.layers\.\d+\.self_attn\.sinks",
    r"model\.layers\.\d+\.mlp\.router\.(weight|bias)",
)


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # one expert
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    rope: RopeConfig
    layer_types: tuple[str, ...]  # "sliding_attention" | "full_attention" per layer
    sliding_window: int | None = 128
    rms_norm_eps: float = 1e-5
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    tie_word_embeddings: bool = False
    model_type: str = "gpt_oss"

    def __post_init__(self) -> None:
        settle_decoder_config(self, "gpt_oss")
        if len(self.layer_types) != self.num_hidden_layers:
            raise CheckpointError(
                f"layer_types names {len(self.layer_types)} layers, the model has "
                f"{self.num_hidden_layers}; fix config.json"
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise CheckpointError(
                "layer_types has sliding layers but sliding_window is unset; fix config.json"
            )

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        """From a config.json dict; unknown keys are ignored."""
        require_keys(d, REQUIRED, "gpt-oss")
        kw = config_kwargs(cls, d, exclude=("rope", "layer_types"), aliases=ALIASES)
        n, heads = int(d["num_hidden_layers"]), int(d["num_attention_heads"])
        kw.setdefault("num_key_value_heads", heads)
        kw.setdefault("head_dim", int(d["hidden_size"]) // heads)
        kw.setdefault("num_local_experts", 128)
        kw.setdefault("num_experts_per_tok", 4)
        types = d.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)
        ]
        kw["layer_types"] = tuple(types)
        kw["rope"] = RopeConfig.from_config(d, kw["head_dim"], default_theta=150000.0, defaults=ROPE_DEFAULTS)
        return cls(**kw)

    def window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate_up [n, 2I] with gate/up interleaved -> [n, I]."""
    gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class Model(GQADecoder):
    """gpt-oss decoder driven layer by layer (see ``deltafin.models.base``)."""

    OPTIONAL = (*GQADecoder.OPTIONAL, "router_b")

    def _layer_names(self, i: int) -> dict[str, str]:
        return {"sinks": "self_attn.sinks", "router": "mlp.router.weight", "router_b": "mlp.router.bias"}

    def _setup(self) -> None:
        super()._setup()
        self.sinks = [dense(lw["sinks"], torch.float32) for lw in self.layers]

    def new_layer_state(self, i: int, max_len: int) -> KVCache:
        c = self.cfg  # a bounded cache: a write past max_len is an error
        return KVCache(
            c.num_key_value_heads, c.head_dim, c.head_dim, max_len, self.device, self.dtype, bounded=True
        )

    def _window(self, i: int) -> int | None:
        return self.cfg.window(i)

    def _sinks(self, i: int) -> torch.Tensor:
        return self.sinks[i]

    _glu = None  # clamped, biased gate-up: no grouped CUDA kernel; the per-expert path runs

    def _expert(self, x: torch.Tensor, t: ExpertTensors) -> torch.Tensor:
        g = clamped_swiglu(
            linear(x, t["gate_up"], t.get("gate_up_bias")), self.cfg.swiglu_alpha, self.cfg.swiglu_limit
        )  # [n, I]
        return linear(g, t["down"], t.get("down_bias"))  # [n, D]

    def _router(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k router logits, softmax over the k chosen."""
        lw = self.layers[i]
        logits = linear(x.float(), lw["router"], lw["router_b"])  # [T, E]
        top = logits.topk(self.cfg.num_experts_per_tok, dim=-1)
        return top.indices, torch.softmax(top.values, dim=-1)
