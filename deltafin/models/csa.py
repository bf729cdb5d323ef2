"""DeepSeek-V4 attention: one shared key/value head beside compressed keys (``deepseek_v4.py`` uses it).

Every layer attends a sliding window of its own keys (K = V, RMS-normed, interleaved RoPE on the *last* r
channels) and, on compressed layers, entries that pool ``rate`` tokens each:

- HCA (heavily compressed, rate 128): one entry per window of ``rate`` tokens, a per-channel softmax (gate
  + position bias) over the window; a query sees the entries whose windows it has finished.
- CSA (compressed sparse, rate 4): entry w pools window w's second half-channels with window w-1's first
  half (2 rate slots, stride rate); the lightning indexer (its own, narrower compressor) scores every entry
  per query, sum_h w_h relu(q_h . k), and the query attends its top ``index_topk`` only.

Each head has a sink logit in its softmax; the output's rope channels are rotated back (-sin) at the query's
position. Legend: T queries, W window, N compressed entries, H heads, d head width, r rope width.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch

from deltafin.models.base import rms_norm, rowwise
from deltafin.models.layers import SCORE_BUDGET, GrowingCache, _probs
from deltafin.models.rope import Rope


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the last r = 2 cos.shape[-1] channels of x [T, ..., d] (pairs (2i, 2i+1) stay in
    place), in float32; cos/sin [T, r/2]."""
    r = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (r,)
    c, s = cos.repeat_interleave(2, -1).view(shape), sin.repeat_interleave(2, -1).view(shape)
    rope = x[..., -r:].float()
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat((x[..., :-r], (rope * c + turned * s).to(x.dtype)), dim=-1)


def cos_sin_at(rope: Rope, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, r/2] float32 at arbitrary positions [n] (compressed entries sit at w * rate)."""
    freqs = positions.to(rope.inv_freq.device).float()[:, None] * rope.inv_freq[None]
    return freqs.cos() * rope.factor, freqs.sin() * rope.factor


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm without a weight over the last dim (the per-head query norm; mHC's stream norm)."""
    ms = x.float().square().mean(-1, keepdim=True) + eps
    return x * rowwise(torch.rsqrt, ms.reshape(-1, 1)).view(ms.shape).to(x.dtype)  # rowwise: batch-invariant


@dataclass
class Compressor:
    """One compressor's running state: tokens of the unfinished window, the last window's first-half slots
    (CSA's overlap), and the entries so far [N, d]."""

    rate: int
    width: int  # d: an entry's channels
    overlap: bool
    entries: GrowingCache
    buf_kv: torch.Tensor | None = None  # [< rate, (1 or 2) d]
    buf_gate: torch.Tensor | None = None
    prev_kv: torch.Tensor | None = None  # [rate, d]: Ca of the last full window (overlap only)
    prev_gate: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return self.entries.length

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {"entries": self.entries.rows(), "buf_kv": self.buf_kv, "buf_gate": self.buf_gate,
                "prev_kv": self.prev_kv, "prev_gate": self.prev_gate}


def compress(st: Compressor, kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, norm_w, eps: float,
             rope: Rope) -> None:
    """Feed kv, gate [T, c] (c = d, or 2 d with overlap) and append every entry whose window they finish."""
    if st.buf_kv is not None:
        kv, gate = torch.cat((st.buf_kv, kv)), torch.cat((st.buf_gate, gate))
    R, d = st.rate, st.width
    n = kv.shape[0] // R
    st.buf_kv, st.buf_gate = kv[n * R :], gate[n * R :]
    if n == 0:
        return
    ck = kv[: n * R].view(n, R, -1)  # [n, R, c]
    cg = gate[: n * R].view(n, R, -1) + bias.to(gate.dtype)
    if st.overlap:  # entry w: window w-1's first half (Ca) then window w's second half (Cb), 2R slots
        slots_kv = ck.new_zeros(n, 2 * R, d)
        slots_g = cg.new_full((n, 2 * R, d), float("-inf"))
        slots_kv[:, R:], slots_g[:, R:] = ck[..., d:], cg[..., d:]
        slots_kv[1:, :R], slots_g[1:, :R] = ck[:-1, :, :d], cg[:-1, :, :d]
        if st.prev_kv is not None:
            slots_kv[0, :R], slots_g[0, :R] = st.prev_kv, st.prev_gate
        st.prev_kv, st.prev_gate = ck[-1, :, :d].clone(), cg[-1, :, :d].clone()
        ck, cg = slots_kv, slots_g
    pooled = (ck * cg.softmax(dim=1, dtype=torch.float32).to(ck.dtype)).sum(dim=1)  # [n, d]
    pooled = rms_norm(pooled, norm_w, eps)
    cos, sin = cos_sin_at(rope, torch.arange(st.count, st.count + n) * R)
    st.entries.write(st.count, rope_tail(pooled, cos, sin))


def finished(pos: int, T: int, rate: int, device) -> torch.Tensor:
    """[T] the number of entries each query at pos .. pos+T-1 may see: windows it has finished."""
    return (torch.arange(pos, pos + T, device=device) + 1) // rate


def index_select(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, pos: int, rate: int, k: int
                 ) -> torch.Tensor:
    """The lightning indexer's choice: q [T, Hi, Di] (roped), weights [T, Hi] (already scaled), keys [N, Di]
    -> keep-mask [T, N] of each query's top k finished entries by sum_h w_h relu(q_h . key / sqrt(Di))."""
    T, Hi, Di = q.shape
    N = keys.shape[0]
    scores = torch.relu(torch.matmul(q.float(), keys.float().T)) * Di**-0.5  # [T, Hi, N]
    index = (scores * weights.float().unsqueeze(-1)).sum(dim=1)  # [T, N]
    seen = finished(pos, T, rate, q.device)[:, None]  # [T, 1]
    later = torch.arange(N, device=q.device)[None] >= seen
    top = index.masked_fill(later, float("-inf")).topk(min(k, N), dim=-1).indices  # [T, k]
    keep = torch.zeros(T, N, dtype=torch.bool, device=q.device).scatter_(1, top, True)
    return keep & ~later


@dataclass
class V4LayerState:
    """One layer's state: the last W-1 keys of the window, and the compressors of a compressed layer
    (``main``; CSA also ``indexer``). Folds tokens into fixed-size pieces, so the prompt cache reuses it whole."""

    window: int
    win: torch.Tensor  # [<= W-1, d]
    main: Compressor | None = None
    indexer: Compressor | None = None
    keep: torch.Tensor | None = field(default=None, repr=False)  # the last call's CSA choice [T, N] (tests)

    def compressors(self) -> list[Compressor]:
        return [c for c in (self.main, self.indexer) if c is not None]

    def nbytes(self) -> int:
        ts = [self.win] + [t for c in self.compressors() for t in c.tensors().values() if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    # the prompt cache's protocol for a model's own state: a frozen copy, and a restore from one
    def freeze(self) -> V4LayerState:
        return self.copy_to("cpu")

    def thaw(self, frozen: V4LayerState) -> None:
        got = frozen.copy_to(self.win.device)
        self.win, self.main, self.indexer = got.win, got.main, got.indexer

    def copy_to(self, device) -> V4LayerState:
        def mv(t):
            return None if t is None else t.to(device, copy=True)

        def comp(c: Compressor | None) -> Compressor | None:
            if c is None:
                return None
            entries = copy.copy(c.entries)
            entries.buf = mv(c.entries.buf)
            return replace(c, entries=entries, buf_kv=mv(c.buf_kv), buf_gate=mv(c.buf_gate), prev_kv=mv(c.prev_kv),
                           prev_gate=mv(c.prev_gate))

        return V4LayerState(self.window, mv(self.win), comp(self.main), comp(self.indexer))


def window_keys(st: V4LayerState, kv: torch.Tensor, pos: int) -> tuple[torch.Tensor, int]:
    """Append kv [T, d] at pos; returns (the keys [S, d] this call reads, the position of their first row)."""
    full = torch.cat((st.win, kv))
    st.win = full[max(0, full.shape[0] - (st.window - 1)) :].clone()
    return full, pos + kv.shape[0] - full.shape[0]


def attend(q: torch.Tensor, keys: torch.Tensor, first: int, pos: int, window: int, comp: torch.Tensor | None,
           comp_keep: torch.Tensor | None, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, d] at pos..; keys [S, d] of positions first.. (the window's, K = V); comp [N, d] compressed
    entries with keep-mask [T, N] (None: all seen). Softmax with each head's sink. Returns [T, H, d]."""
    T, H, d = q.shape
    kv = keys if comp is None else torch.cat((keys, comp))  # [S + N, d]
    S = keys.shape[0]
    qi = torch.arange(pos, pos + T, device=q.device)[:, None]
    kj = torch.arange(first, first + S, device=q.device)[None]
    keep = (kj <= qi) & (kj > qi - window)  # [T, S]
    if comp is not None:
        keep = torch.cat((keep, comp_keep if comp_keep is not None else keep.new_ones(T, comp.shape[0])), dim=1)
    block = max(1, SCORE_BUDGET // (H * kv.shape[0]))
    out = []
    for t0 in range(0, T, block):
        qb = q[t0 : t0 + block]  # [Tb, H, d]
        s = torch.matmul(qb.transpose(0, 1), kv.T) * scale  # [H, Tb, S+N]
        s = s.masked_fill(~keep[t0 : t0 + block][None], float("-inf"))
        p = _probs(s[None], sinks, kv.dtype)[0]  # [H, Tb, S+N]
        out.append(torch.matmul(p, kv).transpose(0, 1))  # [Tb, H, d]
    return out[0] if len(out) == 1 else torch.cat(out)
