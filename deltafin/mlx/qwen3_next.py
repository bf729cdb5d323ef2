"""Qwen3-Next (``qwen3_next``) and Qwen3.5-MoE (``qwen3_5_moe``) in MLX: the torch model's math
(``models.qwen3_next``) on MLX arrays. Gated DeltaNet layers run the delta rule through ``mlx.kda`` (one decay per
head, broadcast over the key channels) on a fixed-size state after the short conv of q, k, v; full-attention
layers take each head's query and output gate from q_proj, norm q and k per head, rotate the first channels
(partial RoPE, halves) and gate the attention's output; every norm but the DeltaNet output's is (1 + w); the
softmax router's experts run by ``gather_qmm`` over the slab's slots, beside a shared expert scaled by
sigmoid(shared_expert_gate x). Legend: T tokens, D width, Hk / Hv key / value heads of the linear layers
(r = Hv / Hk), dk / dv their widths, C = 2 Hk dk + Hv dv conv channels, W conv taps, H / Hkv / d full attention's.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltafin.kernels import mlx as km
from deltafin.mlx import kda as mkda
from deltafin.mlx.model import MLXDecoder, MXKVCache, _plain
from deltafin.models.base import SequenceState
from deltafin.models.common import GQA_LAYER, QK_NORMS, take

_NORMS = {"ln1": "input_layernorm.weight", "ln2": "post_attention_layernorm.weight"}
_FULL = {n: r for n, r in (GQA_LAYER | QK_NORMS).items() if n not in _NORMS}
_LINEAR = {n: f"linear_attn.{n}" for n in ("conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")}
_FUSED = ("in_proj_qkvz", "in_proj_ba")  # Qwen3-Next: q, k, v, z and b, a grouped per key head
_SPLIT = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # Qwen3.5
_MOE = {"router": "mlp.gate.weight", "shared_gate_w": "mlp.shared_expert_gate.weight"} | {
    f"shared_{n}": f"mlp.shared_expert.{n}_proj.weight" for n in ("gate", "up", "down")}
_DENSE = {n: f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}


@dataclass
class MXDeltaState:
    """One Gated DeltaNet layer's state: conv [W-1, C] (the last pre-conv inputs) and S [Hv, dk, dv], float32."""

    conv: object
    S: object


class MLXQwen3Next(MLXDecoder):
    """Legend: T tokens, D width, Hk / Hv key / value heads, dk / dv their widths, H / Hkv / d full attention's."""

    def __init__(self, family: str, text_config: dict, weights: dict, exact: bool, dtype: str = "auto"):
        super().__init__(family, text_config, weights, exact, dtype)
        self.norm = 1.0 + self.norm  # (1 + w), in float32 as the reference

    # ------------------------------------------------------------------ weights
    def _layer(self, weights: dict, i: int) -> dict:
        c, p = self.cfg, f"model.layers.{i}."
        out = {n: 1.0 + self._vec(r) for n, r in take(weights, p, _NORMS).items()}
        out |= self._linear_weights(weights, p) if c.is_linear(i) else self._full_weights(weights, p)
        if not c.is_moe(i):
            return out | {n: self._mat(r) for n, r in take(weights, p, _DENSE).items()}
        lw = take(weights, p, _MOE)
        out["router"] = km.prepare(_plain(lw.pop("router")), km.mx().float32)  # routing in float32
        out["router_b"] = None
        return out | {n: self._mat(r) for n, r in lw.items()}

    def _full_weights(self, weights: dict, p: str) -> dict:
        lw = take(weights, p, _FULL, optional=("q_b", "k_b", "v_b", "o_b"))
        out = {n: self._mat(lw[n]) for n in ("q", "k", "v", "o")}
        out |= {n: self._vec(lw[n]) for n in ("q_b", "k_b", "v_b", "o_b")}
        return out | {n: 1.0 + self._vec(lw[n]) for n in ("qn", "kn")}

    def _linear_weights(self, weights: dict, p: str) -> dict:
        m = km.mx()
        proj = _FUSED if weights.get(f"{p}linear_attn.{_FUSED[0]}.weight") is not None else _SPLIT
        lw = take(weights, p, _LINEAR | {n: f"linear_attn.{n}.weight" for n in proj})
        out = {n: self._mat(lw[n]) for n in proj} | {"out": self._mat(lw["out_proj.weight"])}
        conv = self._vec(lw["conv1d.weight"])
        return out | {"conv": conv.reshape(conv.shape[0], -1), "A": -m.exp(self._vec(lw["A_log"])),  # [C, W], [Hv]
                      "dt_bias": self._vec(lw["dt_bias"]), "o_norm": self._vec(lw["norm.weight"])}

    # ------------------------------------------------------------------ the Model API
    def new_state(self, max_len: int) -> SequenceState:
        c, m = self.cfg, km.mx()
        C = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        return SequenceState([
            MXDeltaState(m.zeros((c.linear_conv_kernel_dim - 1, C), dtype=m.float32),
                         m.zeros((c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
                                 dtype=m.float32))
            if c.is_linear(i) else MXKVCache(self.Hkv, self.d, max_len, self.dtype) for i in range(self.num_layers)])

    def _attention(self, i: int, h, state: SequenceState):
        return self._delta_net(i, h, state.layers[i]) if self.cfg.is_linear(i) else self._full(i, h, state)

    def _full(self, i: int, h, state: SequenceState):
        """Gated full attention: q_proj's [T, H, 2d] is each head's query then its output gate."""
        m, lw, T = km.mx(), self.layers[i], h.shape[0]
        H, Hkv, d = self.H, self.Hkv, self.d
        qg = km.linear(h, lw["q"], lw["q_b"]).reshape(T, H, 2 * d)
        q, gate = qg[..., :d], qg[..., d:]
        k = km.linear(h, lw["k"], lw["k_b"]).reshape(T, Hkv, d)
        v = km.linear(h, lw["v"], lw["v_b"]).reshape(T, Hkv, d)
        q, k = self._qk_norm(lw, q, k)
        q, k, v = (m.transpose(t, (1, 0, 2))[None] for t in (q, k, v))  # [1, H|Hkv, T, d]
        q, k = self._rope(q, state.pos), self._rope(k, state.pos)
        K, V = state.layers[i].update(k, v, state.pos)  # [1, Hkv, S, d]
        o = m.fast.scaled_dot_product_attention(q, K, V, scale=d**-0.5, mask="causal" if T > 1 else None)
        o = m.transpose(o[0], (1, 0, 2)).reshape(T, H * d) * m.sigmoid(gate.reshape(T, H * d))
        return km.linear(o, lw["o"], lw["o_b"])  # [T, D]

    def _projections(self, i: int, h):
        """The conv's input qkv [T, C] (q, k, v in that order), z [T, Hv, dv], b and a [T, Hv]."""
        m, c, lw, T = km.mx(), self.cfg, self.layers[i], h.shape[0]
        Hk, Hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        if "in_proj_qkv" in lw:
            qkv, z, b, a = (km.linear(h, lw[n]) for n in _SPLIT)
            return qkv, z.reshape(T, Hv, dv), b, a
        r = Hv // Hk
        qkvz = km.linear(h, lw["in_proj_qkvz"]).reshape(T, Hk, 2 * dk + 2 * r * dv)
        ba = km.linear(h, lw["in_proj_ba"]).reshape(T, Hk, 2 * r)
        q, k, v, z = (qkvz[..., a:e] for a, e in ((0, dk), (dk, 2 * dk), (2 * dk, 2 * dk + r * dv),
                                                   (2 * dk + r * dv, 2 * dk + 2 * r * dv)))
        qkv = m.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], axis=-1)
        return qkv, z.reshape(T, Hv, dv), ba[..., :r].reshape(T, Hv), ba[..., r:].reshape(T, Hv)

    def _delta_net(self, i: int, h, st: MXDeltaState):
        """Gated DeltaNet: conv'd q/k/v, L2-normed q and k shared by r value heads each, the decay
        -exp(A_log) softplus(a + dt_bias), the delta rule in float32, the gated output norm."""
        m, c, lw, T, f32 = km.mx(), self.cfg, self.layers[i], h.shape[0], km.mx().float32
        Hk, Hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        r = Hv // Hk
        qkv, z, b, a = self._projections(i, h)
        x, st.conv = mkda.short_conv(qkv.astype(f32), lw["conv"], st.conv)  # [T, C], SiLU'd
        q, k, v = x[:, : Hk * dk], x[:, Hk * dk : 2 * Hk * dk], x[:, 2 * Hk * dk :]
        q = m.repeat(mkda.l2norm(q.reshape(T, Hk, dk)), r, axis=1) * dk**-0.5  # [T, Hv, dk]
        k = m.repeat(mkda.l2norm(k.reshape(T, Hk, dk)), r, axis=1)
        beta = m.sigmoid(b.astype(f32))  # [T, Hv]
        g = lw["A"] * m.logaddexp(a.astype(f32) + lw["dt_bias"], 0.0)  # [T, Hv] log-decay (softplus)
        g = m.broadcast_to(g[:, :, None], (T, Hv, dk))  # one decay per head
        o, st.S = (mkda.recurrent if T == 1 else mkda.chunked)(q, k, v.reshape(T, Hv, dv), g, beta, st.S)
        o = m.fast.rms_norm(o, lw["o_norm"], self.eps) * (z.astype(f32) * m.sigmoid(z.astype(f32)))
        return km.linear(o.reshape(T, Hv * dv).astype(h.dtype), lw["out"])

    # ------------------------------------------------------------------ MoE
    def _moe_side(self, i: int, x):
        m, lw = km.mx(), self.layers[i]
        gate = m.sigmoid(km.linear(x, lw["shared_gate_w"]))  # [T, 1]
        return gate * self._swiglu(lw, "shared_", x)
