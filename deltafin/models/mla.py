"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2; Kimi K3 without rotation) over a latent cache.

Legend: T query tokens, S cached tokens (including these T), H heads, R kv_lora_rank, r rope width,
dn / dv the per-head no-rope key and value widths. The cache row of a token is its normalised latent
[R] followed by its rope key [r] (rotated, or as projected for K3's NoPE MLA); K and V are never stored
expanded.

Two equal ways to attend: *absorbed* folds kv_b_proj into the query and the output (cheap when T is
small: decoding), *expanded* rebuilds per-head K/V from the latent for this call only (cheap for long
prefill chunks). ``absorb_is_better`` picks by counting multiply-adds and bounding the expanded K/V.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltafin import kernels
from deltafin.kernels import cuda as kc
from deltafin.models.base import dense, linear, rms_norm
from deltafin.models.layers import attention, attention_upto
from deltafin.quant.record import QTensor

EXPAND_BUDGET = 1 << 28  # most elements of per-call expanded K/V
# transformers builds q_a_layernorm / kv_a_layernorm without the config's eps (DeepSeek-V3, kimi_linear);
# K3 spec §6.2 disagreement 4: colibri, k3_ref and the MLX port use 1e-5; we follow the official files
LATENT_NORM_EPS = 1e-6


def project(
    h: torch.Tensor, p: Callable[[str], QTensor | None], H: int, dn: int, r: int, R: int, q_lora: bool = True,
    qa: torch.Tensor | None = None, kv: torch.Tensor | None = None,
):
    """The MLA projections of h [T, D] from one layer's ``self_attn.`` records ``p(name)`` (None if absent):
    q [T, H, dn+r] (through the q_a/q_b low-rank pair when ``q_lora``, else q_proj), the normalised latent
    [T, R] and the rope key [T, r] before any rotation. ``qa``, ``kv``: q_a h and kv_a h where the caller
    computed them already (one stacked GEMV)."""
    T = h.shape[0]
    if q_lora:
        qa = linear(h, p("q_a_proj.weight"), p("q_a_proj.bias")) if qa is None else qa
        q = linear(rms_norm(qa, p("q_a_layernorm.weight"), LATENT_NORM_EPS), p("q_b_proj.weight"))
    else:
        q = linear(h, p("q_proj.weight"))
    if kv is None:
        kv = linear(h, p("kv_a_proj_with_mqa.weight"), p("kv_a_proj_with_mqa.bias"))  # [T, R+r]
    latent = rms_norm(kv[:, :R], p("kv_a_layernorm.weight"), LATENT_NORM_EPS)  # [T, R]
    return q.view(T, H, dn + r), latent, kv[:, R:]


def absorb_is_better(T: int, S: int, H: int, R: int, r: int, dn: int, dv: int) -> bool:
    # per (head, cached token): absorbed ~ T*(2R + r) MACs, expanded ~ R*(dn+dv) + T*(dn + r + dv)
    cheaper = T * (2 * R - dn - dv) < R * (dn + dv)
    return cheaper or S * H * (dn + r + dv) > EXPAND_BUDGET


def split_kv_b(w: QTensor | torch.Tensor, H: int, dn: int, dv: int, dtype: torch.dtype):
    """kv_b_proj [H*(dn+dv), R] -> (w_uk [H, dn, R], w_uv [H, dv, R])."""
    R = w.shape[-1]
    wh = dense(w, dtype).view(H, dn + dv, R)
    return wh[:, :dn], wh[:, dn:]


def attend_absorbed(q_nope, q_rot, rows, w_kv_b, dn: int, dv: int, scale: float, pos: int | torch.Tensor
                    ) -> torch.Tensor:
    """q_nope [T, H, dn], q_rot [T, H, r], rows [S, R+r] of positions 0..pos+T-1 -> [T, H*dv].

    kv_b_proj is folded into the query and the output, so the latent rows act as one key/value head that
    every query head shares: scores against the whole row (latent, then rope key), values from the latent.
    ``pos`` may be a device tensor [1] for one token: then rows is the latent cache's whole buffer and rows
    past ``pos`` are masked (a decode step replayed from a CUDA graph, no Python int in it).
    """
    T, H, _ = q_nope.shape
    R = rows.shape[-1] - q_rot.shape[-1]
    attend = attention_upto if isinstance(pos, torch.Tensor) else attention
    q_lat = kc.mla_absorb_q(q_nope, w_kv_b)  # one token on the kernel path: from the int8 rows, no bf16 copy
    if q_lat is not None:
        o = kc.mla_attend(q_lat, q_rot, rows, pos, scale)  # flash-decoding over the latent rows
        if o is None:
            o = attend(torch.cat((q_lat, q_rot), dim=-1), rows[None], rows[None, :, :R], pos, scale)
        y = kc.mla_absorb_out(o, w_kv_b, dn)
        if y is not None:
            return y
    cpu = kernels.mla_absorbed_cpu(q_nope, w_kv_b, dn, dv)  # the CPU's fast path: from the int8 rows too
    if cpu is not None:
        q_lat, out = cpu
        return out(attend(torch.cat((q_lat, q_rot), dim=-1), rows[None], rows[None, :, :R], pos, scale))
    w_uk, w_uv = split_kv_b(w_kv_b, H, dn, dv, q_nope.dtype)  # [H, dn, R], [H, dv, R]
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, R]
    o = attend(torch.cat((q_lat, q_rot), dim=-1), rows[None], rows[None, :, :R], pos, scale)  # [T, H, R]
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
