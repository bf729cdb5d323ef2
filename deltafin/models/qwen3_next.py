"""Qwen3-Next (``qwen3_next``) and Qwen3.5-MoE (``qwen3_5_moe``, its text model): a hybrid of Gated DeltaNet
linear attention and gated full attention, every norm (1 + w), a softmax router, and a shared expert scaled by
sigmoid(shared_expert_gate x).

Gated DeltaNet is Kimi K3's delta rule with one decay per head (broadcast over the key channels), so it runs on
``kda.py``'s recurrence, chunked prefill and state (``KDAState``: the short-conv history of q, k and v and the
[Hv, dk, dv] state; the prompt cache keeps it as it keeps K3's). Qwen3-Next projects q, k, v, z per key head in
one matrix (``in_proj_qkvz``, ``in_proj_ba``); Qwen3.5 in four (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``). Full attention: q_proj gives each head's query and its output gate, q and k are normed per
head, partial RoPE (rotated halves; Qwen3.5's multimodal RoPE is the same for text).

Legend: T tokens, D model width, Hk / Hv key / value heads of the linear layers (r = Hv / Hk), dk / dv their
widths, C conv channels (2 Hk dk + Hv dv), H / Hkv / d the full-attention heads and width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from deltafin.errors import UnsupportedArchitectureError
from deltafin.kernels import cuda as kc
from deltafin.models import kda
from deltafin.models.base import SequenceState, dense, linear, linears, rms_norm, rowwise
from deltafin.models.common import (
    READS_GQA,
    READS_QK_NORM,
    READS_TOP,
    DecoderLM,
    config_kwargs,
    require_tensors,
    settle_decoder_config,
    softmax_topk,
)
from deltafin.models.layers import KVCache, self_attention
from deltafin.models.rope import Rope, rope_parameters

MODEL_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
READS = (
    *READS_TOP,
    *READS_GQA,
    *READS_QK_NORM,
    r"model\.layers\.\d+\.linear_attn\.(in_proj_qkvz|in_proj_ba|in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)"
    r"\.weight",
    r"model\.layers\.\d+\.linear_attn\.(conv1d\.weight|A_log|dt_bias|norm\.weight)",
    r"model\.layers\.\d+\.mlp\.(gate|shared_expert_gate)\.weight",
    r"model\.layers\.\d+\.mlp\.(shared_expert\.)?(gate|up|down)_proj\.weight",
)
_ONE_PLUS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
             "self_attn.k_norm.weight")  # (1 + w) norms; the gated output norm of the linear layers is plain w


@dataclass(frozen=True, slots=True)
class Config:
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632  # dense layers
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int | None = 256
    num_experts: int = 512
    num_experts_per_tok: int = 10
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    layer_types: tuple[str, ...] | None = None  # "linear_attention" | "full_attention" per layer
    full_attention_interval: int = 4
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    model_type: str = "qwen3_next"
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.25})

    def __post_init__(self) -> None:
        settle_decoder_config(self, self.model_type)
        if self.model_type not in MODEL_TYPES:
            raise UnsupportedArchitectureError(f"model_type {self.model_type!r} is not served by qwen3_next.py; it "
                                               f"serves {', '.join(MODEL_TYPES)}")
        if self.layer_types is None:  # transformers' default: every full_attention_interval-th layer is full
            kinds = tuple("linear_attention" if (i + 1) % self.full_attention_interval else "full_attention"
                          for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", kinds)
        bad = sorted(set(self.layer_types) - {"linear_attention", "full_attention"})
        if bad or len(self.layer_types) != self.num_hidden_layers:
            raise UnsupportedArchitectureError(f"{self.model_type}: layer_types must name linear_attention or "
                                               f"full_attention for each of {self.num_hidden_layers} layers; got "
                                               f"{bad or len(self.layer_types)}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise UnsupportedArchitectureError(f"{self.model_type}: {self.linear_num_value_heads} value heads do not "
                                               f"share {self.linear_num_key_heads} key heads evenly")

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        """From a config.json dict (Qwen3.5: its text_config); unknown keys are ignored."""
        kw = config_kwargs(cls, d, exclude=("rope", "mlp_only_layers", "layer_types"))
        if d.get("layer_types"):
            kw["layer_types"] = tuple(d["layer_types"])
        kw["mlp_only_layers"] = tuple(d.get("mlp_only_layers") or ())
        if kw.get("model_type", "").startswith("qwen3_5"):  # every layer MoE, the top k always renormalised
            kw.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=())
        rope = rope_parameters(d, 10000.0)
        rope.setdefault("partial_rotary_factor", 0.25)
        return cls(**kw, rope=rope)

    def is_linear(self, i: int) -> bool:
        return self.layer_types[i] == "linear_attention"

    def is_moe(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0


class Model(DecoderLM):
    """The hybrid decoder over DecoderLM's body: per layer a KVCache (full attention) or a KDAState (linear)."""

    def _setup(self) -> None:
        c = self.cfg
        need = []
        for i in range(self.num_layers):
            pre = f"model.layers.{i}."
            need += [pre + "input_layernorm.weight", pre + "post_attention_layernorm.weight"]
            if c.is_linear(i):
                a = pre + "linear_attn."
                proj = ("in_proj_qkvz", "in_proj_ba") if self.w.get(a + "in_proj_qkvz.weight") is not None else \
                    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
                need += [a + n for n in ("conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")]
                need += [f"{a}{p}.weight" for p in proj]
            else:
                need += [f"{pre}self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm",
                                                                 "k_norm")]
            need.append(pre + ("mlp.gate.weight" if c.is_moe(i) else "mlp.gate_proj.weight"))
        require_tensors(self.w, need)
        f32 = torch.float32
        for i in range(self.num_layers):  # (1 + w) once, in float32 as transformers computes it
            for n in _ONE_PLUS:
                w = self._p(i, n)
                if w is not None:
                    self.w[f"model.layers.{i}.{n}"] = 1.0 + dense(w, f32)
            if c.is_linear(i):
                a = f"model.layers.{i}.linear_attn."
                self.w[a + "conv1d.weight"] = dense(self.w[a + "conv1d.weight"], f32).flatten(1)  # [C, W]
                self.w[a + "A_log"] = dense(self.w[a + "A_log"], f32).exp().neg()  # -exp(A_log) [Hv]
                self.w[a + "dt_bias"] = dense(self.w[a + "dt_bias"], f32)
                self.w[a + "norm.weight"] = dense(self.w[a + "norm.weight"], f32)  # the gated norm's, once
        self.norm_w = 1.0 + dense(self.norm_w, f32)
        self.rope = Rope(c.rope, c.head_dim, c.max_position_embeddings, self.device)

    def new_layer_state(self, i: int, max_len: int):
        c = self.cfg
        if not c.is_linear(i):
            return KVCache(c.num_key_value_heads, c.head_dim, c.head_dim, max_len, self.device, self.dtype)
        conv = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        f32 = torch.float32
        return kda.KDAState(torch.zeros(c.linear_conv_kernel_dim - 1, conv, dtype=f32, device=self.device),
                            torch.zeros(c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                                        dtype=f32, device=self.device))

    def _attention(self, i: int, h: torch.Tensor, state: SequenceState) -> torch.Tensor:
        if self.cfg.is_linear(i):
            return self._delta_net(i, h, state.layers[i])
        return self._full(i, h, state)

    def _full(self, i: int, h: torch.Tensor, state: SequenceState) -> torch.Tensor:
        c, T, p = self.cfg, h.shape[0], "self_attn."
        H, Hkv, d, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, self.norm_eps
        q, k, v = linears(h, [self._p(i, f"{p}{n}_proj.weight") for n in "qkv"],
                          [self._p(i, f"{p}{n}_proj.bias") for n in "qkv"])
        q, gate = q.view(T, H, 2 * d).chunk(2, dim=-1)  # [T, H, d] each: the query and its output gate
        q = rms_norm(q, self._p(i, p + "q_norm.weight"), eps)
        k = rms_norm(k.view(T, Hkv, d), self._p(i, p + "k_norm.weight"), eps)
        o = self_attention(q, k, v.view(T, Hkv, d), self.rope, state.layers[i], state.pos, d**-0.5)  # [T, H*d]
        o = o * torch.sigmoid(gate.reshape(T, H * d))
        return linear(o, self._p(i, p + "o_proj.weight"), self._p(i, p + "o_proj.bias"))

    def _projections(self, i: int, h: torch.Tensor):
        """q, k [T, Hk*dk] and v [T, Hv*dv] (the conv's input, in that order), z [T, Hv, dv], b and a [T, Hv]."""
        c, T, a = self.cfg, h.shape[0], "linear_attn."
        Hk, Hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        r = Hv // Hk
        fused = self._p(i, a + "in_proj_qkvz.weight")
        if fused is None:
            qkv, z, b, g = linears(h, [self._p(i, f"{a}in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")],
                                   [None] * 4)
            return qkv, z.view(T, Hv, dv), b, g
        qkvz, ba = linears(h, [fused, self._p(i, a + "in_proj_ba.weight")], [None, None])
        q, k, v, z = qkvz.view(T, Hk, -1).split([dk, dk, r * dv, r * dv], dim=-1)  # grouped per key head
        b, g = ba.view(T, Hk, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return qkv, z.reshape(T, Hv, dv), b.reshape(T, Hv), g.reshape(T, Hv)

    def _delta_net(self, i: int, h: torch.Tensor, st: kda.KDAState) -> torch.Tensor:
        c, T, a = self.cfg, h.shape[0], f"model.layers.{i}.linear_attn."
        Hk, Hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        qkv, z, b, g_in = self._projections(i, h)
        if T == 1 and kc.enabled(h):  # the fast CUDA path: conv to gated norm in one launch
            o = kc.gdn_step(h, Hk, Hv, dk, dv, c.linear_conv_kernel_dim, st.conv, st.S, qkv, self.w[a + "conv1d.weight"],
                            z.reshape(Hv, dv), b, g_in, self.w[a + "A_log"], self.w[a + "dt_bias"],
                            self.w[a + "norm.weight"], self.norm_eps, dk**-0.5, kda.L2_EPS)
            if o is not None:
                return linear(o, self.w[a + "out_proj.weight"])
        x, st.conv = kda.short_conv(qkv.float(), self.w[a + "conv1d.weight"], st.conv)  # [T, C], SiLU'd
        q, k, v = x.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
        r = Hv // Hk
        q = kda.l2norm(q.view(T, Hk, dk)).repeat_interleave(r, dim=1) * dk**-0.5  # [T, Hv, dk]
        k = kda.l2norm(k.view(T, Hk, dk)).repeat_interleave(r, dim=1)
        beta = torch.sigmoid(b.float())  # [T, Hv]
        g = self.w[a + "A_log"] * F.softplus(g_in.float() + self.w[a + "dt_bias"])  # [T, Hv] log-decay
        g = g.unsqueeze(-1).expand(T, Hv, dk)  # one decay per head: KDA's per-channel decay, all equal
        if T == 1:
            o, st.S = kda.recurrent(q, k, v.view(T, Hv, dv), g, beta, st.S)  # [T, Hv, dv]
        else:  # KDA's chunked prefill, with its fused in-chunk products on the fast CUDA path
            products = kc.kda_products if kc.enabled(h) else None
            o, st.S = kda.chunked(q, k, v.view(T, Hv, dv), g, beta, st.S, products=products)
        o = rms_norm(o, self.w[a + "norm.weight"], self.norm_eps) * F.silu(z.float())  # the gated output norm
        return linear(o.reshape(T, Hv * dv).to(h.dtype), self.w[a + "out_proj.weight"])

    def _is_moe(self, i: int) -> bool:
        return self.cfg.is_moe(i)

    def _moe_side(self, i: int, x: torch.Tensor) -> torch.Tensor:
        gate = rowwise(torch.sigmoid, linear(x, self._p(i, "mlp.shared_expert_gate.weight")))  # [T, 1]
        return gate * self._swiglu(i, "mlp.shared_expert.", x)

    def _router(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x, self._p(i, "mlp.gate.weight"))  # [T, E]
        return softmax_topk(logits, self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob)
