"""Attention for every family: growable per-position caches and causal attention over grouped heads.

- ``GrowingCache(row, max_len, device, dtype)``: ``.write(pos, rows)`` -> rows of positions 0..pos+T-1
  (an MLA latent cache: ``row = (latent + rope key,)``).
- ``KVCache(n_kv_heads, k_dim, v_dim, max_len, device, dtype)``: ``.update(k, v, pos)`` -> all keys and
  values, head-major as ``attention`` reads them.
- ``attention(q, k, v, pos, scale, window=None, sinks=None)``: causal (optionally sliding-window) GQA, with
  gpt-oss' per-head sinks; MLA passes its latent rows as one shared key/value head.
- ``self_attention(q, k, v, rope, cache, pos, scale, window=None, sinks=None)``: RoPE + cache + attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltafin.kernels import attend_rows
from deltafin.models.rope import Rope, apply_rope

INITIAL_ROWS = 64
SCORE_BUDGET = 1 << 26  # attention scores held at once (elements), bounding prefill memory


class GrowingCache:
    """Positions [0, length) of a per-position buffer of rows ``row`` that doubles when full (amortised O(1)
    appends; never a torch.cat per step). Positions run along ``axis`` of the buffer: 0 gives [cap, *row],
    1 with row (H, d) gives head-major [H, cap, d]. Capacity stays within ``max_len`` while writes fit in it;
    a write past it fails when ``bounded``, else doubles the buffer (the caller enforces the context limit).
    """

    def __init__(
        self,
        row: tuple[int, ...],
        max_len: int,
        device,
        dtype: torch.dtype,
        initial: int = INITIAL_ROWS,
        axis: int = 0,
        bounded: bool = True,
    ):
        self.row, self.max_len, self.axis, self.bounded = tuple(row), max_len, axis, bounded
        self.buf = torch.empty(self._shape(max(1, min(initial, max_len))), device=device, dtype=dtype)
        self.length = 0
        self._finite = False  # the buffer holds max_len rows, finite past length (``whole``)

    def _shape(self, capacity: int) -> tuple[int, ...]:
        return (*self.row[: self.axis], capacity, *self.row[self.axis :])

    @property
    def capacity(self) -> int:
        return self.buf.shape[self.axis]

    def write(self, pos: int, rows: torch.Tensor) -> torch.Tensor:
        """Store rows [T, *row] at positions pos .. pos+T-1 (pos <= length: a rewind drops what follows) and
        return the buffer's view of positions [0, pos+T)."""
        end = pos + rows.shape[0]
        self.reserve(pos, rows.shape[0]).narrow(self.axis, pos, end - pos).copy_(rows.movedim(0, self.axis))
        return self.buf.narrow(self.axis, 0, end)

    def write_at(self, at: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Store one row [1, *row] at the position held in the device tensor ``at`` [1] and return the whole
        buffer (positions past ``at`` hold older rows or zeros). For a step recorded into a CUDA graph, where
        no Python int may pick the position; the caller moves ``length`` on (it knows the position)."""
        assert self.axis == 0 and rows.shape[0] == 1, "write_at takes one row of a position-major cache"
        return self.buf.index_copy_(0, at, rows)

    def whole(self) -> torch.Tensor:
        """The buffer at ``max_len`` positions, finite past ``length`` (zeros where nothing was written): what a
        one-token step attends over with the later rows masked (``write_at``), as the CUDA graphs' buffers are,
        so an eager step and a replayed one compute the same numbers."""
        if self.capacity < self.max_len or not self._finite:
            buf = self.buf.new_zeros(self._shape(max(self.max_len, self.capacity)))
            buf.narrow(self.axis, 0, self.length).copy_(self.rows())
            self.buf, self._finite = buf, True
        return self.buf

    def reserve(self, pos: int, T: int) -> torch.Tensor:
        """Positions pos .. pos+T-1 made the last ones (pos <= length; the buffer grown where needed) for the caller
        to fill in place (``write``, the CPU's fused one-token attention); returns the whole buffer."""
        end = pos + T
        assert pos <= self.length, f"cache write at {pos} leaves a gap after {self.length}"
        assert end <= self.max_len or not self.bounded, (
            f"sequence of {end} tokens exceeds the state's max_len {self.max_len}"
        )
        if end > self.capacity:
            self._grow(end)
        self.length = end
        return self.buf

    def _grow(self, end: int) -> None:
        self._finite = False
        capacity = max(2 * self.capacity, end)
        if end <= self.max_len:
            capacity = min(capacity, self.max_len)
        buf = self.buf.new_empty(self._shape(capacity))
        buf.narrow(self.axis, 0, self.length).copy_(self.rows())
        self.buf = buf

    def rows(self) -> torch.Tensor:
        return self.buf.narrow(self.axis, 0, self.length)


class KVCache:
    """One layer's keys [Hkv, S, dk] and values [Hkv, S, dv], head-major. ``max_len`` is the expected
    sequence length: a longer one doubles the buffers unless ``bounded``."""

    def __init__(
        self, n_kv_heads: int, k_dim: int, v_dim: int, max_len: int, device, dtype, bounded: bool = False
    ):
        self.keys = GrowingCache((n_kv_heads, k_dim), max_len, device, dtype, axis=1, bounded=bounded)
        self.values = GrowingCache((n_kv_heads, v_dim), max_len, device, dtype, axis=1, bounded=bounded)

    @property
    def k(self) -> torch.Tensor:
        return self.keys.buf

    @property
    def v(self) -> torch.Tensor:
        return self.values.buf

    @property
    def length(self) -> int:
        return self.keys.length

    def update(self, k: torch.Tensor, v: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k [T, Hkv, dk], v [T, Hkv, dv] at positions pos..pos+T-1 (pos <= length: rewinding is
        allowed) and return the keys and values of positions 0..pos+T-1: [Hkv, pos+T, dk], [Hkv, pos+T, dv]."""
        return self.keys.write(pos, k), self.values.write(pos, v)


def visible(pos: int, T: int, start: int, end: int, window: int | None, device) -> torch.Tensor | None:
    """Keep-mask [T, end-start] for queries at pos .. pos+T-1 over keys start .. end-1: key j is seen from
    query p iff j <= p (and p - window < j); None when one query sees every key given (decode)."""
    if T == 1 and end == pos + 1 and (window is None or pos - start < window):
        return None
    qi = torch.arange(pos, pos + T, device=device)[:, None]  # [T, 1]
    kj = torch.arange(start, end, device=device)[None]  # [1, S]
    keep = kj <= qi
    return keep if window is None else keep & (kj > qi - window)


def _probs(s: torch.Tensor, sinks: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Softmax of masked scores s [Hkv, G, Tb, Sb] over Sb in float32; with sinks [H], each head's sink
    logit joins its softmax and is then dropped (gpt-oss), so a head may attend to nothing."""
    if sinks is None:
        return torch.softmax(s, dim=-1, dtype=torch.float32).to(dtype)
    Hkv, G, Tb, _ = s.shape
    logits = torch.cat((s, sinks.view(Hkv, G, 1, 1).expand(Hkv, G, Tb, 1).to(s.dtype)), dim=-1).float()
    logits = logits - logits.amax(-1, keepdim=True)
    return torch.softmax(logits, dim=-1)[..., :-1].to(dtype)


def _attention_grouped(q, k, v, pos: int, scale: float, window: int | None, sinks=None) -> torch.Tensor:
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
        mask = visible(pos + t0, Tb, k0, k1, window, q.device)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        p = _probs(s, sinks, v.dtype)  # [Hkv, G, Tb, Sb]
        out.append((p.view(Hkv, G * Tb, k1 - k0) @ v[:, k0:k1]).view(Hkv, G, Tb, dv))
    o = out[0] if len(out) == 1 else torch.cat(out, dim=2)  # [Hkv, G, T, dv]
    return o.permute(2, 0, 1, 3).reshape(T, H, dv)


def _attention_sdpa(q, k, v, pos: int, scale: float, window: int | None) -> torch.Tensor:
    T, H, _ = q.shape
    Hkv, S, _ = k.shape
    mask = visible(pos, T, 0, S, window, q.device)  # [T, S] or None
    qb, kb, vb = q.transpose(0, 1)[None], k[None], v[None]  # batch of one: the fused kernels want 4-D
    o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=H != Hkv)
    return o[0].transpose(0, 1)  # [T, H, dv]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query causal attention.

    q [T, H, dk] holds positions pos..pos+T-1; k [Hkv, S, dk] and v [Hkv, S, dv] positions 0..S-1 with
    S = pos + T. Query i sees key j iff j <= i (and i - j < window). sinks [H]: per-head logits that join
    the softmax (gpt-oss). Returns [T, H, dv]. On CUDA without sinks this is torch's fused attention; on the
    CPU's fast path one compiled call (``attend_rows``, also within ``gqa_one``); elsewhere (the exact
    path) a grouped matmul form.
    """
    T, H, _ = q.shape
    Hkv, S, _ = k.shape
    assert S == pos + T and H % Hkv == 0
    if q.device.type == "cpu":  # the CPU's fast path: one compiled call, flash-style, only the keys a query sees
        o = attend_rows(q, k, v, pos, scale, window, sinks)
        if o is not None:
            return o
    if q.device.type == "cuda" and sinks is None:
        return _attention_sdpa(q, k, v, pos, scale, window)
    return _attention_grouped(q, k, v, pos, scale, window, sinks)


def attention_upto(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token at the position held in the device tensor ``at`` [1] over whole cache buffers:
    q [1, H, dk], k [Hkv, C, dk], v [Hkv, C, dv] with C >= at + 1; keys past ``at`` are masked (their rows must
    be finite). The grouped form of ``attention`` for any device (no copies of K/V per query head), with the
    same operations in the same order, so on the CPU it equals ``attention(q, k[:, :at+1], ...)``.
    Returns [1, H, dv]."""
    T, H, dk = q.shape
    Hkv, C, dv = v.shape
    G = H // Hkv
    qg = q.reshape(T, Hkv, G, dk).permute(1, 2, 0, 3)  # [Hkv, G, 1, dk]
    s = (qg.reshape(Hkv, G * T, dk) @ k.transpose(1, 2) * scale).view(Hkv, G, T, C)
    hide = torch.arange(C, device=q.device) > at  # [C] keys after the query's position
    p = _probs(s.masked_fill(hide, float("-inf")), None, v.dtype)  # [Hkv, G, 1, C]
    o = (p.view(Hkv, G * T, C) @ v).view(Hkv, G, T, dv)
    return o.permute(2, 0, 1, 3).reshape(T, H, dv)


def self_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: Rope,
    cache: KVCache,
    pos: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE on q [T, H, d] and k [T, Hkv, d], append k and v [T, Hkv, dv] to the cache at ``pos``, attend.
    Returns the heads concatenated: [T, H * dv]."""
    T = q.shape[0]
    cos, sin = rope.cos_sin(pos, T)  # [T, r/2]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    keys, values = cache.update(k, v, pos)  # [Hkv, pos+T, d]
    return attention(q, keys, values, pos, scale, window, sinks).reshape(T, -1)
