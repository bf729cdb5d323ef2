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
from deltafin.models.layers import attention
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


def attend_absorbed(q_nope, q_rot, rows, w_kv_b, dn: int, dv: int, scale: float, pos: int) -> torch.Tensor:
    """q_nope [T, H, dn], q_rot [T, H, r], rows [S, R+r] of positions 0..pos+T-1 -> [T, H*dv].

    kv_b_proj is folded into the query and the output, so the latent rows act as one key/value head that
    every query head shares: scores against the whole row (latent, then rope key), values from the latent.
    """
    T, H, _ = q_nope.shape
    R = rows.shape[-1] - q_rot.shape[-1]
    w_uk, w_uv = split_kv_b(w_kv_b, H, dn, dv, q_nope.dtype)  # [H, dn, R], [H, dv, R]
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, R]
    o = attention(torch.cat((q_lat, q_rot), dim=-1), rows[None], rows[None, :, :R], pos, scale)  # [T, H, R]
    return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).reshape(T, H * dv)


def attend_expanded(q_nope, q_rot, rows, w_kv_b, dn: int, dv: int, scale: float, pos: int) -> torch.Tensor:
    """Same contract as attend_absorbed; per-head K/V rebuilt from the latent for this call only."""
    T, H, _ = q_nope.shape
    S, r = rows.shape[0], q_rot.shape[-1]
    R = rows.shape[-1] - r
    kv = linear(rows[:, :R], w_kv_b).view(S, H, dn + dv)  # [S, H, dn+dv]
    k = torch.cat((kv[..., :dn], rows[:, None, R:].expand(S, H, r)), dim=-1).transpose(0, 1)  # [H, S, dn+r]
    v = kv[..., dn:].transpose(0, 1)  # [H, S, dv]
    return attention(torch.cat((q_nope, q_rot), dim=-1), k, v, pos, scale).reshape(T, H * dv)
