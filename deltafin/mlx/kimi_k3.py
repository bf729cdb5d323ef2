"""Kimi K3 in MLX: the torch model's math (``models.kimi_k3``, ../shared/specs/KIMI_K3.md) on MLX arrays.

AttnRes carries a partial sum and block snapshots (``K3Carry``), mixed per token before each sublayer; KDA layers
run the delta rule through ``mlx.kda`` (the step for one token, the chunked WY form for more) on a fixed-size
state; MLA layers attend without rotation over a latent cache with the output gate; the Stable LatentMoE routes on
the normed input (sigmoid, correction bias for the choice only), runs the routed experts in the latent by
``gather_qmm`` over the slab's slots with SiTU-GLU, norms their sum, projects it up and adds the shared experts.
Legend: T tokens, D width, H heads, K KDA head width, C = H K channels, W conv taps, Lat the latent width.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deltafin.kernels import mlx as km
from deltafin.mlx import kda as mkda
from deltafin.mlx.model import MLXDecoder, MXKVCache, _plain
from deltafin.models.base import SequenceState
from deltafin.models.common import sigmoid_topk, take
from deltafin.models.kimi_k3 import A_LOG_FIRST_HEAD
from deltafin.models.mla import LATENT_NORM_EPS

_RES = {"ln1": "input_layernorm.weight", "ln2": "post_attention_layernorm.weight",
        "attn_res_n": "self_attention_res_norm.weight", "attn_res_p": "self_attention_res_proj.weight",
        "mlp_res_n": "mlp_res_norm.weight", "mlp_res_p": "mlp_res_proj.weight"}
_KDA = {n: f"self_attn.{n}_proj.weight" for n in ("q", "k", "v", "f_a", "f_b", "b", "g", "o")} | {
    "q_conv": "self_attn.q_conv1d.weight", "k_conv": "self_attn.k_conv1d.weight", "v_conv": "self_attn.v_conv1d.weight",
    "A_log": "self_attn.A_log", "dt_bias": "self_attn.dt_bias", "o_norm": "self_attn.o_norm.weight"}
_MLA = {"q_a": "self_attn.q_a_proj.weight", "q_a_b": "self_attn.q_a_proj.bias", "q_a_ln": "self_attn.q_a_layernorm.weight",
        "q_b": "self_attn.q_b_proj.weight", "kv_a": "self_attn.kv_a_proj_with_mqa.weight",
        "kv_a_b": "self_attn.kv_a_proj_with_mqa.bias", "kv_a_ln": "self_attn.kv_a_layernorm.weight",
        "kv_b": "self_attn.kv_b_proj.weight", "o": "self_attn.o_proj.weight", "g": "self_attn.g_proj.weight"}
_MOE = {"router": "block_sparse_moe.gate.weight", "bias": "block_sparse_moe.gate.e_score_correction_bias",
        "lat_down": "block_sparse_moe.routed_expert_down_proj.weight",
        "lat_up": "block_sparse_moe.routed_expert_up_proj.weight",
        "lat_norm": "block_sparse_moe.routed_expert_norm.weight"} | {
    f"shared_{n}": f"block_sparse_moe.shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")}
_DENSE = {n: f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
_VECTORS = ("ln1", "ln2", "q_a_b", "q_a_ln", "kv_a_b", "kv_a_ln", "dt_bias", "o_norm", "lat_norm")


class K3Carry:
    """The AttnRes stream of T tokens: the partial sum p [T, D] and the block snapshots (each [T, D])."""

    def __init__(self, p, blocks: tuple = ()):
        self.p, self.blocks = p, blocks

    @classmethod
    def cat(cls, carries: list[K3Carry]) -> K3Carry:
        m = km.mx()
        blocks = tuple(m.concatenate(list(b)) for b in zip(*(c.blocks for c in carries), strict=True))
        return cls(m.concatenate([c.p for c in carries]), blocks)

    def split(self, sizes) -> list[K3Carry]:
        m = km.mx()
        cuts = np.cumsum(list(sizes))[:-1].tolist()
        ps, bs = m.split(self.p, cuts), [m.split(b, cuts) for b in self.blocks]
        return [K3Carry(p, tuple(b[j] for b in bs)) for j, p in enumerate(ps)]


@dataclass
class MXKDAState:
    """One KDA layer's state: conv [3, W-1, C] (the last inputs of q, k, v) and S [H, K, K], float32."""

    conv: object
    S: object


class MLXKimiK3(MLXDecoder):
    """Legend: T tokens, D width, H heads, K KDA head width, R kv_lora_rank, r the (unrotated) rope width."""

    def _setup_rope(self) -> None:  # NoPE MLA, no rope anywhere
        self.rope_dims, self.rope_factor, self.freqs = 0, 1.0, None

    @property
    def act(self) -> tuple:
        c = self.cfg
        return ("situ", c.activation_situ_beta, c.activation_situ_linear_beta)

    # ------------------------------------------------------------------ weights
    def _res(self, n, p):
        """An AttnRes query vector: res_norm.weight * res_proj.weight, float32 [D]."""
        return (self._vec(n) * self._vec(p)).reshape(-1)

    def _layer(self, weights: dict, i: int) -> dict:
        c, p = self.cfg, f"model.layers.{i}."
        res = take(weights, p, _RES)
        out = {"ln1": self._vec(res["ln1"]), "ln2": self._vec(res["ln2"]),
               "attn_res": self._res(res["attn_res_n"], res["attn_res_p"]),
               "mlp_res": self._res(res["mlp_res_n"], res["mlp_res_p"])}
        if c.is_kda(i):
            lw = take(weights, p, _KDA)
            out |= {n: self._mat(lw[n]) for n in ("q", "k", "v", "f_a", "f_b", "b", "g", "o")}
            out |= {f"{n}_conv": self._vec(lw[f"{n}_conv"]).reshape(c.kda_num_heads * c.kda_head_dim, -1) for n in "qkv"}
            a = self._vec(lw["A_log"]).reshape(-1)
            out |= {"A": km.mx().exp(a[A_LOG_FIRST_HEAD : A_LOG_FIRST_HEAD + c.kda_num_heads]),
                    "dt_bias": self._vec(lw["dt_bias"]), "o_norm": self._vec(lw["o_norm"])}
        else:
            lw = take(weights, p, _MLA, optional=("q_a_b", "kv_a_b") + ("g",) * (not c.mla_use_output_gate))
            out |= {n: (self._vec if n in _VECTORS else self._mat)(r) if r is not None else None for n, r in lw.items()}
        if c.is_moe(i):
            lw = take(weights, p, _MOE, optional=("lat_norm", "shared_gate", "shared_up", "shared_down"))
            out |= {n: (self._vec if n in _VECTORS else self._mat)(r) if r is not None else None for n, r in lw.items()
                    if n not in ("router", "bias")}
            out["router"] = km.prepare(_plain(lw["router"]), km.mx().float32)  # routing in float32, as the reference
            out["bias"] = lw["bias"]  # on the host, where the top k is taken
        else:
            out |= {n: self._mat(r) for n, r in take(weights, p, _DENSE).items()}
        return out

    def __init__(self, family: str, text_config: dict, weights: dict, exact: bool, dtype: str = "auto"):
        super().__init__(family, text_config, weights, exact, dtype)
        top = take(weights, "model.", {"n": "output_attn_res_norm.weight", "p": "output_attn_res_proj.weight"})
        self.out_res = self._res(top["n"], top["p"])

    # ------------------------------------------------------------------ the Model API
    def new_state(self, max_len: int) -> SequenceState:
        c, m = self.cfg, km.mx()
        C, W = c.kda_num_heads * c.kda_head_dim, c.short_conv_kernel_size
        return SequenceState([
            MXKDAState(m.zeros((3, W - 1, C), dtype=m.float32),
                       m.zeros((c.kda_num_heads, c.kda_head_dim, c.kda_head_dim), dtype=m.float32))
            if c.is_kda(i) else MXKVCache(1, c.kv_lora_rank + c.qk_rope_head_dim, max_len, self.dtype, values=False)
            for i in range(self.num_layers)])

    def embed(self, ids: torch.Tensor) -> K3Carry:
        return K3Carry(super().embed(ids).x)  # the embedding is the first partial sum (§3.3)

    def _mix_norm(self, carry: K3Carry, w, norm_w):
        """rms_norm(Mix(p, blocks), norm_w): the softmax over [b_0.., p] of their RMS-normed rows . w (§3.3)."""
        m, p = km.mx(), carry.p
        if carry.blocks:
            V = m.stack([*carry.blocks, p]).astype(m.float32)  # [n+1, T, D]
            keys = V * m.rsqrt((V * V).mean(-1, keepdims=True) + self.eps)
            pi = m.softmax(keys @ w, axis=0)  # [n+1, T]
            p = (pi[..., None] * V).sum(0).astype(carry.p.dtype)
        return m.fast.rms_norm(p, norm_w.astype(p.dtype), self.eps)

    def attn_part(self, i: int, carry: K3Carry, state: SequenceState) -> K3Carry:
        lw = self.layers[i]
        x = self._mix_norm(carry, lw["attn_res"], lw["ln1"])
        p, blocks = carry.p, carry.blocks
        if i % self.cfg.attn_res_block_size == 0:  # snapshot the raw incoming sum, after the mix above
            blocks, p = (*blocks, p), None
        a = self._kda(i, x, state.layers[i]) if self.cfg.is_kda(i) else self._attention(i, x, state)
        return K3Carry(a if p is None else p + a, blocks)

    def _mlp_input(self, i: int, carry: K3Carry):
        lw = self.layers[i]
        return self._mix_norm(carry, lw["mlp_res"], lw["ln2"])

    def mlp_part(self, i: int, carry: K3Carry, experts) -> K3Carry:
        m, lw = km.mx(), self.layers[i]
        x = self._mlp_input(i, carry)
        y = self._moe(i, x, experts) if self._is_moe(i) else self._swiglu(lw, "", x, self.act)
        out = carry.p + y.astype(carry.p.dtype)
        m.async_eval(out)
        return K3Carry(out, carry.blocks)

    def head(self, carry: K3Carry) -> torch.Tensor:
        m = km.mx()
        h = self._mix_norm(carry, self.out_res, self.norm)
        return torch.from_numpy(np.array(km.linear(h, self.lm_head).astype(m.float32)))  # [T, V]

    # ------------------------------------------------------------------ attention
    def _kda(self, i: int, x, st: MXKDAState):
        """KDA (§3.1): conv'd q/k/v, the lower-bound decay, the delta rule in float32, the gated head norm."""
        m, c, lw, T = km.mx(), self.cfg, self.layers[i], x.shape[0]
        H, K, f32 = c.kda_num_heads, c.kda_head_dim, m.float32
        qkv, hist = [], []
        for j, n in enumerate("qkv"):
            y, h = mkda.short_conv(km.linear(x, lw[n]).astype(f32), lw[f"{n}_conv"], st.conv[j])  # [T, C]
            qkv.append(y.reshape(T, H, K))
            hist.append(h)
        st.conv = m.stack(hist)
        q, k, v = mkda.l2norm(qkv[0]) * K**-0.5, mkda.l2norm(qkv[1]), qkv[2]
        z = km.linear(km.linear(x, lw["f_a"]), lw["f_b"]).astype(f32) + lw["dt_bias"]
        g = c.gate_lower_bound * m.sigmoid(lw["A"][:, None] * z.reshape(T, H, K))  # [T, H, K] log-decay
        beta = m.sigmoid(km.linear(x, lw["b"]).astype(f32))  # [T, H]
        o, st.S = (mkda.recurrent if T == 1 else mkda.chunked)(q, k, v, g, beta, st.S)
        gate = m.sigmoid(km.linear(x, lw["g"]).astype(f32)).reshape(T, H, K)
        o = m.fast.rms_norm(o, lw["o_norm"], c.rms_norm_eps) * gate  # [T, H, K]
        return km.linear(o.reshape(T, H * K).astype(x.dtype), lw["o"])

    def _attention(self, i: int, h, state: SequenceState):
        """Gated MLA without rotation (§3.2): per-head K/V rebuilt from the cached latent rows for each call."""
        m, c, lw, T = km.mx(), self.cfg, self.layers[i], h.shape[0]
        H, dn, r, R, dv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.v_head_dim
        qa = m.fast.rms_norm(km.linear(h, lw["q_a"], lw["q_a_b"]), lw["q_a_ln"].astype(h.dtype), LATENT_NORM_EPS)
        q = m.transpose(km.linear(qa, lw["q_b"]).reshape(T, H, dn + r), (1, 0, 2))[None]  # [1, H, T, dn + r]
        kv = km.linear(h, lw["kv_a"], lw["kv_a_b"])  # [T, R + r]
        latent = m.fast.rms_norm(kv[:, :R], lw["kv_a_ln"].astype(h.dtype), LATENT_NORM_EPS)
        row = m.concatenate([latent, kv[:, R:]], axis=-1)[None, None]  # [1, 1, T, R + r]
        rows, _ = state.layers[i].update(row, None, state.pos)
        S = rows.shape[2]
        kvb = km.linear(rows[0, 0, :, :R], lw["kv_b"]).reshape(S, H, dn + dv)  # [S, H, dn + dv]
        k = m.concatenate([kvb[..., :dn], m.broadcast_to(rows[0, 0, :, None, R:], (S, H, r))], axis=-1)
        k, v = m.transpose(k, (1, 0, 2))[None], m.transpose(kvb[..., dn:], (1, 0, 2))[None]
        o = m.fast.scaled_dot_product_attention(q, k, v, scale=(dn + r) ** -0.5, mask="causal" if T > 1 else None)
        o = m.transpose(o[0], (1, 0, 2)).reshape(T, H * dv)
        if lw["g"] is not None:
            o = o * m.sigmoid(km.linear(h, lw["g"]).astype(m.float32)).astype(o.dtype)
        return km.linear(o, lw["o"])

    # ------------------------------------------------------------------ MoE
    def _router(self, i: int, x) -> tuple[np.ndarray, np.ndarray]:
        """§3.4 step 1 on the device's float32 logits, the top k on the host (the layer's one synchronisation)."""
        m, c, lw = km.mx(), self.cfg, self.layers[i]
        logits = torch.from_numpy(np.array(km.linear(x.astype(m.float32), lw["router"])))  # [T, E]
        ids, w = sigmoid_topk(logits, lw["bias"], c.num_experts_per_token, c.moe_renormalize, c.routed_scaling_factor)
        return ids.numpy(), w.numpy().astype(np.float32)

    def _moe(self, i: int, x, experts):
        """Stable LatentMoE (§3.4): route on x, experts in the latent z, norm their sum, up, + shared(x)."""
        m, c, lw = km.mx(), self.cfg, self.layers[i]
        ids, w = self._router(i, x)
        z = km.linear(x, lw["lat_down"])  # [T, Lat]
        slot_of, views = experts.slots(i, sorted(set(ids.reshape(-1).tolist())))
        idx = m.array(np.vectorize(slot_of.__getitem__, otypes=[np.uint32])(ids))  # [T, k] slots
        ys = km.glu(z, views, idx, self.act)  # [T, k, Lat]
        y = (ys * m.array(w)[:, :, None].astype(ys.dtype)).sum(axis=1).astype(z.dtype)  # slot order: fixed
        experts.mlx_slab.fence(y)  # the slots read here are free once y is computed
        if c.latent_moe_use_norm:
            y = m.fast.rms_norm(y, lw["lat_norm"].astype(y.dtype), c.rms_norm_eps)
        y = km.linear(y, lw["lat_up"])  # [T, D]
        return y if lw["shared_gate"] is None else y + self._swiglu(lw, "shared_", x, self.act).astype(y.dtype)

