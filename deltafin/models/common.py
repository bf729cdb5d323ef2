"""Pieces shared by the model families: SwiGLU experts, softmax top-k routing, config and weight helpers,
and the decoder body (embed, layer loop, head). RoPE is in ``rope.py``, caches and attention in ``layers.py``.

Stable API for every family module:

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
from deltafin.quant.record import QTensor

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
