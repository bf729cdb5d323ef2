"""Multi-head latent attention (DeepSeek-V2/V3) over a latent cache.

Legend: T query tokens, S cached tokens (including these T), H heads, R kv_lora_rank, r rotary width,
dn / dv the per-head no-rope key and value widths. The cache row of a token is its normalised latent
[R] followed by its rotated key [r]; K and V are never stored expanded.

Two equal ways to attend: *absorbed* folds kv_b_proj into the query and the output (cheap when T is
small: decoding), *expanded* rebuilds per-head K/V from the latent for this call only (cheap for long
prefill chunks). ``absorb_is_better`` picks by counting multiply-adds and bounding the expanded K/V.
"""

from __future__ import annotations

import torch

from deltafin.models.base import dense, linear
from deltafin.models.ops import blockwise_attention
from deltafin.quant.record import QTensor

EXPAND_BUDGET = 1 << 28  # most elements of per-call expanded K/V


def absorb_is_better(T: int, S: int, H: int, R: int, r: int, dn: int, dv: int) -> bool:
    # per (head, cached token): absorbed ~ T*(2R + r) MACs, expanded ~ R*(dn+dv) + T*(dn + r + dv)
    cheaper = T * (2 * R - dn - dv) < R * (dn + dv)
    return cheaper or S * H * (dn + r + dv) > EXPAND_BUDGET


def split_kv_b(w: QTensor | torch.Tensor, H: int, dn: int, dv: int, dtype: torch.dtype):
    """kv_b_proj [H*(dn+dv), R] -> (w_uk [H, dn, R], w_uv [H, dv, R])."""
    R = w.shape[-1]
    wh = dense(w, dtype).view(H, dn + dv, R)
    return wh[:, :dn], wh[:, dn:]


def attend_absorbed(q_nope, q_rot, cache_rows, w_kv_b, dn: int, dv: int, scale: float, keep) -> torch.Tensor:
    """q_nope [T, H, dn], q_rot [T, H, r], cache_rows [S, R+r], keep [T, S] or None -> [T, H*dv]."""
    T, H, _ = q_nope.shape
    S, r = cache_rows.shape[0], q_rot.shape[-1]
    R = cache_rows.shape[-1] - r
    latent, k_rot = cache_rows[:, :R], cache_rows[:, R:]  # [S, R], [S, r]
    w_uk, w_uv = split_kv_b(w_kv_b, H, dn, dv, q_nope.dtype)
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk)  # [H, T, R]
    q_r = q_rot.transpose(0, 1)  # [H, T, r]

    def scores_of(t0: int, t1: int) -> torch.Tensor:
        return (q_lat[:, t0:t1] @ latent.T + q_r[:, t0:t1] @ k_rot.T) * scale  # [H, Tb, S]

    def values_of(p: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        return torch.bmm(p @ latent, w_uv.transpose(1, 2))  # [H, Tb, R] -> [H, Tb, dv]

    out = blockwise_attention(scores_of, values_of, T, H, S, keep, q_nope.dtype)  # [H, T, dv]
    return out.transpose(0, 1).reshape(T, H * dv)


def attend_expanded(q_nope, q_rot, cache_rows, w_kv_b, dn: int, dv: int, scale: float, keep) -> torch.Tensor:
    """Same contract as attend_absorbed."""
    T, H, _ = q_nope.shape
    S, r = cache_rows.shape[0], q_rot.shape[-1]
    R = cache_rows.shape[-1] - r
    kv = linear(cache_rows[:, :R], w_kv_b).view(S, H, dn + dv)  # [S, H, dn+dv]
    k = torch.cat((kv[..., :dn], cache_rows[:, None, R:].expand(S, H, r)), dim=-1).permute(
        1, 2, 0
    )  # [H, dn+r, S]
    v = kv[..., dn:].transpose(0, 1)  # [H, S, dv]
    q = torch.cat((q_nope, q_rot), dim=-1).transpose(0, 1)  # [H, T, dn+r]

    def scores_of(t0: int, t1: int) -> torch.Tensor:
        return (q[:, t0:t1] @ k) * scale  # [H, Tb, S]

    def values_of(p: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        return p @ v  # [H, Tb, dv]

    out = blockwise_attention(scores_of, values_of, T, H, S, keep, q_nope.dtype)
    return out.transpose(0, 1).reshape(T, H * dv)
