"""The DeepSeek-V3 family in MLX (DeepSeek-V3/R1, Kimi K2/K2.5, GLM-4.7-Flash): MLA over a latent cache, a
sigmoid group-limited router with a selection-only bias and a routed scaling factor, shared experts, dense first
layers. Attention rebuilds per-head keys and values from the cached latent rows for each call (``mla.py``'s
expanded form) and runs ``mx.fast.scaled_dot_product_attention``; RoPE pairs are interleaved (``traditional``),
which leaves every q.k product as the torch model's de-interleaved form gives it."""

from __future__ import annotations

import numpy as np
import torch

from deltafin.kernels import mlx as km
from deltafin.mlx.model import MLXDecoder, MXKVCache
from deltafin.models.base import SequenceState
from deltafin.models.common import sigmoid_topk, take
from deltafin.models.mla import LATENT_NORM_EPS

_MLA = {"ln1": "input_layernorm.weight", "ln2": "post_attention_layernorm.weight",
        "q_a": "self_attn.q_a_proj.weight", "q_a_b": "self_attn.q_a_proj.bias",
        "q_a_ln": "self_attn.q_a_layernorm.weight",
        "q_b": "self_attn.q_b_proj.weight", "q": "self_attn.q_proj.weight",
        "kv_a": "self_attn.kv_a_proj_with_mqa.weight", "kv_a_b": "self_attn.kv_a_proj_with_mqa.bias",
        "kv_a_ln": "self_attn.kv_a_layernorm.weight",
        "kv_b": "self_attn.kv_b_proj.weight", "o": "self_attn.o_proj.weight", "o_b": "self_attn.o_proj.bias"}
_SHARED = {"shared_gate": "mlp.shared_experts.gate_proj.weight", "shared_up": "mlp.shared_experts.up_proj.weight",
           "shared_down": "mlp.shared_experts.down_proj.weight"}
_VECTORS = ("ln1", "ln2", "q_a_b", "q_a_ln", "kv_a_b", "kv_a_ln", "o_b")


class MLXDeepSeek(MLXDecoder):
    """Legend: T tokens, S cached, H heads, R kv_lora_rank, r rope width, dn / dv per-head key / value widths."""

    def _attn_weights(self, weights: dict, p: str) -> dict:
        lora = self.cfg.q_lora_rank is not None
        optional = ("o_b", "q_a_b", "kv_a_b") + (("q",) if lora else ("q_a", "q_a_ln", "q_b"))
        lw = take(weights, p, _MLA, optional=optional)
        return {n: (self._vec if n in _VECTORS else self._mat)(r) if r is not None else None for n, r in lw.items()}

    def _layer(self, weights: dict, i: int) -> dict:
        out = super()._layer(weights, i)
        if self._is_moe(i) and self.cfg.n_shared_experts:
            out |= {n: self._mat(r) for n, r in take(weights, f"model.layers.{i}.", _SHARED).items()}
        if self._is_moe(i):
            out["bias"] = weights.get(f"model.layers.{i}.mlp.gate.e_score_correction_bias")
        return out

    def new_state(self, max_len: int) -> SequenceState:
        c = self.cfg
        width = c.kv_lora_rank + c.qk_rope_head_dim
        return SequenceState([MXKVCache(1, width, max_len, self.dtype, values=False) for _ in range(self.num_layers)])

    def _attention(self, i: int, h, state: SequenceState):
        q, q_rot, row, _ = self._project(i, h, state.pos)
        rows, _ = state.layers[i].update(row, None, state.pos)
        return self._mla(i, q, q_rot, rows, "causal" if h.shape[0] > 1 else None)

    def _project(self, i: int, h, pos: int):
        """q [1, H, T, dn + r] (its rope part not yet rotated), q_rot [1, H, T, r], the cache rows [1, 1, T, R + r]
        (normed latent, rotated key) and the query's normed low-rank residual [T, q_lora_rank] (None without)."""
        m, c, lw, T = km.mx(), self.cfg, self.layers[i], h.shape[0]
        H, dn, r, R = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        qa = None
        if lw["q_a"] is not None:
            qa = m.fast.rms_norm(km.linear(h, lw["q_a"], lw["q_a_b"]), lw["q_a_ln"].astype(h.dtype), LATENT_NORM_EPS)
            q = km.linear(qa, lw["q_b"])
        else:
            q = km.linear(h, lw["q"])
        q = m.transpose(q.reshape(T, H, dn + r), (1, 0, 2))[None]  # [1, H, T, dn + r]
        kv = km.linear(h, lw["kv_a"], lw["kv_a_b"])  # [T, R + r]
        latent = m.fast.rms_norm(kv[:, :R], lw["kv_a_ln"].astype(h.dtype), LATENT_NORM_EPS)
        k_rot = self._rope(kv[None, None, :, R:], pos)  # [1, 1, T, r]
        return q, self._rope(q[..., dn:], pos), m.concatenate([latent[None, None], k_rot], axis=-1), qa

    def _mla(self, i: int, q, q_rot, rows, mask):
        """Attention over the cached rows [1, 1, S, R + r], per-head K/V rebuilt from them for this call."""
        m, c, lw = km.mx(), self.cfg, self.layers[i]
        H, dn, r, R, dv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.v_head_dim
        S, T = rows.shape[2], q.shape[2]
        kvb = km.linear(rows[0, 0, :, :R], lw["kv_b"]).reshape(S, H, dn + dv)  # [S, H, dn + dv]
        k = m.concatenate([kvb[..., :dn], m.broadcast_to(rows[0, 0, :, None, R:], (S, H, r))], axis=-1)
        k, v = m.transpose(k, (1, 0, 2))[None], m.transpose(kvb[..., dn:], (1, 0, 2))[None]
        qf = m.concatenate([q[..., :dn], q_rot], axis=-1)
        o = m.fast.scaled_dot_product_attention(qf, k, v, scale=c.softmax_scale, mask=mask)
        o = m.transpose(o[0], (1, 0, 2)).reshape(T, H * dv)
        return km.linear(o, lw["o"], lw["o_b"])

    def _rope(self, x, pos: int):
        m = km.mx()
        y = m.fast.rope(x, self.rope_dims, traditional=self.cfg.rope_interleave, base=None, scale=1.0, offset=pos,
                        freqs=self.freqs)
        return y * self.rope_factor if self.rope_factor != 1.0 else y

    def _router(self, i: int, x) -> tuple[np.ndarray, np.ndarray]:
        """The torch family's sigmoid, group-limited top-k on the host, on the device's float32 logits."""
        m, c, lw = km.mx(), self.cfg, self.layers[i]
        logits = torch.from_numpy(np.array(km.linear(x.astype(m.float32), lw["router"])))  # [T, E]
        ids, w = sigmoid_topk(logits, lw["bias"], c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor,
                              c.n_group, c.topk_group)
        return ids.numpy(), w.numpy().astype(np.float32)

    def _moe_side(self, i: int, x):
        return self._swiglu(self.layers[i], "shared_", x) if self.cfg.n_shared_experts else None
