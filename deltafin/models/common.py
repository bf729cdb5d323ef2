"""Pieces shared by the model families: a growable KV cache, GQA causal attention, SwiGLU experts,
softmax top-k routing, and the decoder body (embed, layer loop, head). RoPE is in ``rope.py``.

Stable API for every family module:

- ``KVCache(n_kv_heads, k_dim, v_dim, max_len, device, dtype)``: ``.update(k, v, pos)`` -> all keys/values.
- ``causal_attention(q, k, v, pos, scale, window=None)`` and ``self_attention(...)`` (rope + cache + attention).
- ``swiglu_expert(x, tensors)``, ``softmax_topk(logits, k, renormalize)``.
- ``config_kwargs(cls, d)``: the known, non-null fields of an HF config dict.
- ``take(weights, prefix, names)``: named records with one clear error for missing ones.
- ``DecoderLM``: embed / head / forward / new_state for models whose carry is the [T, D] residual stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields

import torch
import torch.nn.functional as F

from deltafin.errors import CheckpointError
from deltafin.models.base import ExpertSource, SequenceState, Weights, embed_rows, linear, rms_norm
from deltafin.models.rope import Rope, apply_rope
from deltafin.quant.record import QTensor

# ------------------------------------------------------------------------------------------ attention


class KVCache:
    """One layer's keys [Hkv, cap, dk] and values [Hkv, cap, dv]; capacity grows geometrically.

    ``max_len`` is the expected sequence length: capacity never exceeds it unless a write needs more.
    Any per-position rows fit (an MLA latent cache: n_kv_heads=1, k_dim=latent, v_dim=rope key).
    """

    MIN_CAPACITY = 64

    def __init__(self, n_kv_heads: int, k_dim: int, v_dim: int, max_len: int, device, dtype: torch.dtype):
        self.max_len = max_len
        self.k = torch.empty(n_kv_heads, 0, k_dim, device=device, dtype=dtype)
        self.v = torch.empty(n_kv_heads, 0, v_dim, device=device, dtype=dtype)
        self.length = 0

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.k.shape[1], self.MIN_CAPACITY)
        if need <= self.max_len:
            cap = min(cap, self.max_len)
        H, n = self.k.shape[0], self.length
        k = self.k.new_empty(H, cap, self.k.shape[2])
        v = self.v.new_empty(H, cap, self.v.shape[2])
        k[:, :n] = self.k[:, :n]
        v[:, :n] = self.v[:, :n]
        self.k, self.v = k, v

    def update(self, k: torch.Tensor, v: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k [T, Hkv, dk], v [T, Hkv, dv] at positions pos..pos+T-1 (pos <= length: rewinding is
        allowed) and return the keys and values of positions 0..pos+T-1: [Hkv, pos+T, dk], [Hkv, pos+T, dv]."""
        assert pos <= self.length, f"KV cache holds {self.length} positions; cannot write at {pos}"
        end = pos + k.shape[0]
        if end > self.k.shape[1]:
            self._grow(end)
        self.k[:, pos:end] = k.transpose(0, 1)
        self.v[:, pos:end] = v.transpose(0, 1)
        self.length = end
        return self.k[:, :end], self.v[:, :end]


SCORE_BUDGET = 1 << 26  # attention scores held at once (elements), bounding prefill memory


def _visible(q0: int, Tb: int, k0: int, k1: int, window: int | None, device) -> torch.Tensor | None:
    """Mask [Tb, k1-k0] of the keys k0..k1-1 that queries q0..q0+Tb-1 see; None when all are visible."""
    if Tb == 1 and k1 == q0 + 1 and (window is None or q0 - k0 < window):
        return None  # one query that sees every key given (decode)
    qi = torch.arange(q0, q0 + Tb, device=device)[:, None]  # [Tb, 1]
    kj = torch.arange(k0, k1, device=device)[None]  # [1, Sb]
    mask = kj <= qi
    return mask if window is None else mask & (kj > qi - window)


def _attention_grouped(q, k, v, pos: int, scale: float, window: int | None) -> torch.Tensor:
    """Query heads grouped by their key/value head (no copies of K/V), queries in blocks that keep the
    scores under SCORE_BUDGET; each block reads only the keys it can see. Softmax in float32."""
    T, H, dk = q.shape
    Hkv, S, dv = v.shape
    G = H // Hkv
    qg = q.reshape(T, Hkv, G, dk).permute(1, 2, 0, 3)  # [Hkv, G, T, dk]; query head h uses kv head h // G
    block = max(1, SCORE_BUDGET // (H * S))
    out = []
    for t0 in range(0, T, block):
        Tb = min(block, T - t0)
        k1 = pos + t0 + Tb  # causal: no key past the block's last query
        k0 = 0 if window is None else max(0, pos + t0 - window + 1)
        s = qg[:, :, t0 : t0 + Tb].reshape(Hkv, G * Tb, dk) @ k[:, k0:k1].transpose(1, 2)  # [Hkv, G*Tb, Sb]
        s = (s * scale).view(Hkv, G, Tb, k1 - k0)
        mask = _visible(pos + t0, Tb, k0, k1, window, q.device)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(v.dtype)  # [Hkv, G, Tb, Sb]
        out.append((p.view(Hkv, G * Tb, k1 - k0) @ v[:, k0:k1]).view(Hkv, G, Tb, dv))
    o = out[0] if len(out) == 1 else torch.cat(out, dim=2)  # [Hkv, G, T, dv]
    return o.permute(2, 0, 1, 3).reshape(T, H, dv)


def _attention_sdpa(q, k, v, pos: int, scale: float, window: int | None) -> torch.Tensor:
    T, H, _ = q.shape
    Hkv, S, _ = k.shape
    mask = _visible(pos, T, 0, S, window, q.device)  # [T, S] or None
    qb, kb, vb = q.transpose(0, 1)[None], k[None], v[None]  # batch of one: the fused kernels want 4-D
    o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=H != Hkv)
    return o[0].transpose(0, 1)  # [T, H, dv]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, scale: float, window: int | None = None
) -> torch.Tensor:
    """Grouped-query causal attention.

    q [T, H, dk] holds positions pos..pos+T-1; k [Hkv, S, dk] and v [Hkv, S, dv] positions 0..S-1 with
    S = pos + T. Query i sees key j iff j <= i (and i - j < window). Returns [T, H, dv].
    On CUDA this is torch's fused attention; elsewhere a grouped matmul form, which on CPU is many times
    faster than torch's kernel for decode and no slower for prefill.
    """
    T, H, _ = q.shape
    Hkv, S, _ = k.shape
    assert S == pos + T and H % Hkv == 0
    if q.device.type == "cuda":
        return _attention_sdpa(q, k, v, pos, scale, window)
    return _attention_grouped(q, k, v, pos, scale, window)


def self_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: Rope,
    cache: KVCache,
    pos: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """RoPE on q [T, H, d] and k [T, Hkv, d], append k and v [T, Hkv, dv] to the cache at ``pos``, attend.
    Returns the heads concatenated: [T, H * dv]."""
    T = q.shape[0]
    cos, sin = rope.cos_sin(pos, T)  # [T, r/2]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    keys, values = cache.update(k, v, pos)  # [Hkv, pos+T, d]
    return causal_attention(q, keys, values, pos, scale, window).reshape(T, -1)


# ------------------------------------------------------------------------------------------- MLP / MoE


def swiglu_expert(x: torch.Tensor, tensors: Mapping[str, QTensor | torch.Tensor]) -> torch.Tensor:
    """down(silu(gate x) * up x) for x [n, D] and records gate/up [I, D], down [D, I]. Returns [n, D]."""
    return linear(F.silu(linear(x, tensors["gate"])) * linear(x, tensors["up"]), tensors["down"])


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in float32, then the top k; optionally renormalised to sum to 1.

    logits [T, E] -> (ids [T, k] long, weights [T, k] float32), ids in descending weight order.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


# ---------------------------------------------------------------------------------------- configs


def config_kwargs(cls, d: Mapping) -> dict:
    """The entries of an HF config dict that name fields of the dataclass ``cls``; unknown keys and
    explicit nulls (HF's "use the default") are dropped."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names and v is not None}


# ---------------------------------------------------------------------------------------- weights


def take(weights: Weights, prefix: str, names: Mapping[str, str], optional: tuple[str, ...] = ()) -> dict:
    """{short: weights[prefix + name]} for every entry of ``names``; optional ones may be absent (None).
    Raises one CheckpointError naming every missing required tensor."""
    out = {short: weights.get(prefix + name) for short, name in names.items()}
    missing = [prefix + names[s] for s, t in out.items() if t is None and s not in optional]
    if missing:
        raise CheckpointError(
            f"the packed trunk has no tensor(s) {missing}; the model was packed from another architecture or "
            f"is incomplete: repack it"
        )
    return out


# ---------------------------------------------------------------------------------------- decoder body


class DecoderLM:
    """Embed, final norm + lm_head and the layer loop of a decoder whose carry is the residual stream
    [T, D]. Subclasses implement ``attn_part``, ``mlp_part``, ``route`` and ``new_layer_state``."""

    num_layers: int
    vocab_size: int

    def __init__(
        self,
        weights: Weights,
        device: torch.device | str,
        dtype: torch.dtype,
        norm_eps: float,
        tie_word_embeddings: bool = False,
    ):
        self.device = torch.device(device)
        self.dtype = dtype
        self.norm_eps = norm_eps
        self.w: dict[str, QTensor | torch.Tensor] = {n: t.to(self.device) for n, t in weights.items()}
        top = take(
            self.w,
            "",
            {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"},
            optional=("lm_head",),
        )
        self.embed_w, self.norm_w = top["embed"], top["norm"]
        self.lm_head = top["embed"] if tie_word_embeddings or top["lm_head"] is None else top["lm_head"]

    def new_layer_state(self, i: int, max_len: int):
        raise NotImplementedError

    def attn_part(self, i: int, carry: torch.Tensor, state: SequenceState) -> torch.Tensor:
        raise NotImplementedError

    def mlp_part(self, i: int, carry: torch.Tensor, experts: ExpertSource) -> torch.Tensor:
        raise NotImplementedError

    def new_state(self, max_len: int) -> SequenceState:
        return SequenceState([self.new_layer_state(i, max_len) for i in range(self.num_layers)])

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return embed_rows(self.embed_w, ids.to(self.device), self.dtype)  # [T, D]

    def head(self, carry: torch.Tensor) -> torch.Tensor:
        h = rms_norm(carry, self.norm_w, self.norm_eps)  # [T, D]
        return linear(h, self.lm_head).float()  # [T, V]

    def forward(self, ids: torch.Tensor, state: SequenceState, experts: ExpertSource) -> torch.Tensor:
        x = self.embed(ids)  # [T, D]
        for i in range(self.num_layers):
            x = self.attn_part(i, x, state)
            x = self.mlp_part(i, x, experts)
        state.pos += ids.shape[0]
        return self.head(x)  # [T, V]
