"""GLM-4.5/4.6/4.7 (``glm4_moe``) and MiniMax-M2 (``minimax_m2``) in MLX: GQA with partial RoPE (rotated halves
over the first channels of each head, ``mx.fast.rope``'s ``dims``) and DeepSeek-V3's sigmoid router (the
correction bias picks the experts only). GLM-4.5: optional per-head q/k norms and q/k/v biases, router groups,
one shared expert added unweighted, dense first layers. MiniMax-M2: q and k RMS-normed over all heads at once,
no groups, no shared expert. The torch models are ``models.glm4_moe`` and ``models.minimax_m2``."""

from __future__ import annotations

import numpy as np
import torch

from deltafin.kernels import mlx as km
from deltafin.mlx.model import MLXDecoder, _plain
from deltafin.models.common import sigmoid_topk, take

_MOE = {"glm4_moe": {"router": "mlp.gate.weight", "bias": "mlp.gate.e_score_correction_bias"},
        "minimax_m2": {"router": "block_sparse_moe.gate.weight", "bias": "block_sparse_moe.e_score_correction_bias"}}
_SHARED = {f"shared_{n}": f"mlp.shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")}
_DENSE = {n: f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}


class MLXSigmoidGQA(MLXDecoder):
    """Legend: T tokens, D width, H query heads, Hkv key/value heads, d head width, E experts, k per token."""

    def _has_qk_norms(self) -> bool:
        return self.family == "minimax_m2" or self.cfg.use_qk_norm

    def _layer(self, weights: dict, i: int) -> dict:
        p = f"model.layers.{i}."
        out = self._attn_weights(weights, p)
        if not self._is_moe(i):
            return out | {n: self._mat(r) for n, r in take(weights, p, _DENSE).items()}
        lw = take(weights, p, _MOE[self.family], optional=("bias",))
        out["router"] = km.prepare(_plain(lw["router"]), km.mx().float32)  # routing in float32, as the reference
        out["bias"] = lw["bias"]  # on the host, where the top k is taken
        if getattr(self.cfg, "n_shared_experts", 0):
            out |= {n: self._mat(r) for n, r in take(weights, p, _SHARED).items()}
        return out

    def _qkv(self, i: int, h):
        lw, T = self.layers[i], h.shape[0]
        q, k, v = (km.linear(h, lw[n], lw[f"{n}_b"]) for n in ("q", "k", "v"))  # [T, H d], [T, Hkv d] x2
        if self.family == "minimax_m2":  # one norm over all heads' channels
            q, k = self._qk_norm(lw, q, k)
        q, k, v = q.reshape(T, self.H, self.d), k.reshape(T, self.Hkv, self.d), v.reshape(T, self.Hkv, self.d)
        if self.family == "glm4_moe" and self.cfg.use_qk_norm:  # per head
            q, k = self._qk_norm(lw, q, k)
        return q, k, v

    def _router(self, i: int, x) -> tuple[np.ndarray, np.ndarray]:
        """The torch families' sigmoid top k on the host, on the device's float32 logits."""
        m, c, lw = km.mx(), self.cfg, self.layers[i]
        logits = torch.from_numpy(np.array(km.linear(x.astype(m.float32), lw["router"])))  # [T, E]
        if self.family == "minimax_m2":
            ids, w = sigmoid_topk(logits, lw["bias"], c.num_experts_per_tok, True, 1.0)
        else:
            ids, w = sigmoid_topk(logits, lw["bias"], c.num_experts_per_tok, c.norm_topk_prob,
                                  c.routed_scaling_factor, c.n_group, c.topk_group)
        return ids.numpy(), w.numpy().astype(np.float32)

    def _moe_side(self, i: int, x):
        return self._swiglu(self.layers[i], "shared_", x) if getattr(self.cfg, "n_shared_experts", 0) else None
