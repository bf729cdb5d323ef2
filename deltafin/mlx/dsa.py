"""DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``) in MLX: DeepSeek-V3's MLA and router
(``mlx.deepseek``) with DSA's lightning indexer choosing, per query, the ``index_topk`` earlier tokens attention
reads (the torch model: ``models.deepseek_v32``).

The indexer's key per token (``wk``, a LayerNorm, RoPE on its first r channels: rotated halves in V3.2,
interleaved pairs in GLM-5) is cached beside the latent rows; a query's score of a token is
sum_h w_h relu(q_h . k / sqrt(Di)), w = weights_proj(x) / sqrt(Hi). The choice is kept as a boolean mask [T, S]
that ``mx.fast.scaled_dot_product_attention`` takes with the causal one; GLM-5's ``shared`` layers reuse the
previous full layer's mask. Legend: T queries, S cached tokens, Hi / Di indexer heads / width, k index_topk.
"""

from __future__ import annotations

import numpy as np

from deltafin.kernels import mlx as km
from deltafin.mlx.deepseek import MLXDeepSeek
from deltafin.mlx.model import MXKVCache
from deltafin.models.base import SequenceState
from deltafin.models.common import take
from deltafin.models.deepseek_v32 import INDEXER_NORM_EPS

_INDEXER = {f"ix_{n}": f"self_attn.indexer.{n}.weight" for n in ("wq_b", "wk", "weights_proj")} | {
    "ix_ln_w": "self_attn.indexer.k_norm.weight", "ix_ln_b": "self_attn.indexer.k_norm.bias"}


class MXDSACache(MXKVCache):
    """A DSA layer's cache: latent rows [1, 1, S, R + r] as keys, indexer keys [1, 1, S, Di] as values, and the
    last call's choice (``chosen``: [T, S] bool) for the shared layers after it."""

    chosen = None


class MLXDSA(MLXDeepSeek):
    """Legend: T tokens, S cached, H heads, R kv_lora_rank, r rope width, Hi / Di indexer heads / width."""

    def _layer(self, weights: dict, i: int) -> dict:
        out = super()._layer(weights, i)
        if self.cfg.indexer_types[i] == "shared":  # reads the full layer's choice: no indexer of its own
            return out
        ix = take(weights, f"model.layers.{i}.", _INDEXER)
        return out | {n: (self._vec if n.startswith("ix_ln") else self._mat)(r) for n, r in ix.items()}

    def new_state(self, max_len: int) -> SequenceState:
        c = self.cfg
        width = c.kv_lora_rank + c.qk_rope_head_dim
        return SequenceState([MXDSACache(1, width, max_len, self.dtype, dv=c.index_head_dim)
                              for _ in range(self.num_layers)])

    def _attention(self, i: int, h, state: SequenceState):
        m, c, lw, T, pos = km.mx(), self.cfg, self.layers[i], h.shape[0], state.pos
        q, q_rot, row, q_resid = self._project(i, h, pos)
        full = c.indexer_types[i] == "full"
        ikey = self._index_key(lw, h, pos) if full else m.zeros((T, c.index_head_dim), dtype=h.dtype)
        cache = state.layers[i]
        rows, ikeys = cache.update(row, ikey[None, None], pos)  # [1, 1, S, R + r], [1, 1, S, Di]
        if full:
            cache.chosen = self._select(lw, h, q_resid, ikeys[0, 0], pos)
        else:  # GLM-5: the last full layer's choice for these queries
            cache.chosen = next(state.layers[j].chosen for j in range(i - 1, -1, -1) if c.indexer_types[j] == "full")
        return self._mla(i, q, q_rot, rows, cache.chosen)

    def _index_rope(self, x, pos: int):
        """RoPE on the first r channels of x [..., T, Di] in the indexer's own pairing (halves or interleaved)."""
        m, r = km.mx(), self.cfg.qk_rope_head_dim
        y = m.fast.rope(x, r, traditional=self.cfg.indexer_interleaved, base=None, scale=1.0, offset=pos,
                        freqs=self.freqs)
        if self.rope_factor != 1.0:  # YaRN's cos/sin factor, on the rotated channels only
            y = m.concatenate([y[..., :r] * self.rope_factor, y[..., r:]], axis=-1)
        return y

    def _index_key(self, lw: dict, h, pos: int):
        """Each token's indexer key [T, Di]: LayerNorm(wk h) in float32, its first r channels rotated."""
        m = km.mx()
        k = m.fast.layer_norm(km.linear(h, lw["ix_wk"]).astype(m.float32), lw["ix_ln_w"], lw["ix_ln_b"],
                              INDEXER_NORM_EPS).astype(h.dtype)
        return self._index_rope(k[None], pos)[0]

    def _select(self, lw: dict, h, q_resid, ikeys, pos: int):
        """The mask [T, S] of the index_topk tokens each query reads: the best scores among the causal ones
        (a later token scores -inf), causal."""
        m, c, T = km.mx(), self.cfg, h.shape[0]
        Hi, Di, S = c.index_n_heads, c.index_head_dim, ikeys.shape[0]
        q = m.transpose(km.linear(q_resid, lw["ix_wq_b"]).reshape(T, Hi, Di), (1, 0, 2))  # [Hi, T, Di]
        q = self._index_rope(q, pos).astype(m.float32)
        scores = m.maximum(q @ ikeys.astype(m.float32).T * Di**-0.5, 0)  # [Hi, T, S]
        w = km.linear(h, lw["ix_weights_proj"]).astype(m.float32) * Hi**-0.5  # [T, Hi]
        index = (m.transpose(w, (1, 0))[:, :, None] * scores).sum(0)  # [T, S]
        causal = m.array(np.arange(S)[None, :] <= np.arange(pos, pos + T)[:, None])
        index = m.where(causal, index, -float("inf"))
        k = min(c.index_topk, S)
        top = m.argpartition(-index, kth=k - 1, axis=-1)[:, :k]  # [T, k]
        chosen = m.put_along_axis(m.zeros((T, S), dtype=m.bool_), top, m.array(True), axis=-1)
        return chosen & causal
