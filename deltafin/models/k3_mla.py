"""Kimi K3 gated MLA without positional encoding (../shared/specs/KIMI_K3.md §3.2).

Letters: T new tokens, S cached tokens (incl. the new ones), H heads, N nope width, P rope width,
R latent width (kv_lora_rank), V value width. The cache holds the normalised latent and the
un-rotated rope key per token (R + P values); no rotation is applied anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# §6.2 disagreement 4: the official q_a_layernorm / kv_a_layernorm are built with the class default
# eps 1e-6 (colibri, k3_ref and the MLX port use 1e-5). We follow the official files.
MLA_LATENT_NORM_EPS = 1e-6


@dataclass(slots=True)
class MLACache:
    kv: torch.Tensor  # [max_len, R + P]: normalised latent c, then k_pe, per token


@dataclass(frozen=True, slots=True)
class MLADims:
    heads: int
    nope: int
    rope: int
    v: int
    latent: int  # R

    @property
    def scale(self) -> float:
        return (self.nope + self.rope) ** -0.5  # §3.2 step 4: 192^-0.5 for K3


def causal_mask(T: int, S: int, device: torch.device) -> torch.Tensor:
    """[T, S] True where query t (at position S-T+t) may see key s."""
    qpos = torch.arange(S - T, S, device=device).unsqueeze(1)
    return torch.arange(S, device=device).unsqueeze(0) <= qpos


def _softmax(scores: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    scores = scores.float().masked_fill(~mask, float("-inf"))
    return scores.softmax(-1).to(dtype)  # §3.2 step 4: softmax in fp32


def attend_expanded(
    q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, wkv: torch.Tensor, d: MLADims
) -> torch.Tensor:
    """Per-head keys and values expanded from the latent (prefill form).

    q_nope [T, H, N], q_pe [T, H, P], kv [S, R+P], wkv [H, N+V, R] (kv_b_proj by head). Returns [T, H, V].
    """
    T, S = q_nope.shape[0], kv.shape[0]
    c, k_pe = kv.split([d.latent, d.rope], -1)  # [S, R], [S, P]
    kvb = torch.einsum("sr,hjr->shj", c, wkv)  # [S, H, N+V]
    k_nope, v = kvb.split([d.nope, d.v], -1)
    scores = torch.einsum("thn,shn->hts", q_nope, k_nope) + torch.einsum("thp,sp->hts", q_pe, k_pe)
    p = _softmax(scores * d.scale, causal_mask(T, S, kv.device), q_nope.dtype)  # [H, T, S]
    return torch.einsum("hts,shv->thv", p, v)


def attend_absorbed(
    q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, wkv: torch.Tensor, d: MLADims
) -> torch.Tensor:
    """Attention in latent space (decode form, §3.2 absorbed): kv_b folded into the query and the output."""
    T, S = q_nope.shape[0], kv.shape[0]
    c, k_pe = kv.split([d.latent, d.rope], -1)
    wk, wv = wkv.split([d.nope, d.v], 1)  # [H, N, R], [H, V, R]
    q_abs = torch.einsum("thn,hnr->thr", q_nope, wk)  # [T, H, R]
    scores = torch.einsum("thr,sr->hts", q_abs, c) + torch.einsum("thp,sp->hts", q_pe, k_pe)
    p = _softmax(scores * d.scale, causal_mask(T, S, kv.device), q_nope.dtype)  # [H, T, S]
    latent = torch.einsum("hts,sr->thr", p, c)  # [T, H, R]
    return torch.einsum("thr,hvr->thv", latent, wv)
