"""Pieces shared by the model families: SwiGLU experts, softmax top-k routing, config and weight helpers,
and the decoder body (embed, layer loop, head). RoPE is in ``rope.py``, caches and attention in ``layers.py``.

Stable API for every family module:

- ``swiglu_expert(x, tensors)``, ``softmax_topk(logits, k, renormalize)``.
- ``config_kwargs(cls, d, exclude, aliases)``: the known, non-null fields of an HF config dict;
  ``require_keys(d, keys, family)``; ``settle_decoder_config(cfg, family)``: head defaults and checks.
- ``take(weights, prefix, names)``: named records with one clear error for missing ones.
- ``DecoderLM``: embed / head / forward / new_state for models whose carry is the [T, D] residual stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields

import torch
import torch.nn.functional as F

from deltafin.errors import CheckpointError, UnsupportedArchitectureError
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


def config_kwargs(cls, d: Mapping, exclude: Iterable[str] = (), aliases: Mapping[str, str] | None = None) -> dict:
    """The entries of an HF config dict that name fields of the dataclass ``cls`` (less ``exclude``); unknown
    keys and explicit nulls (HF's "use the default") are dropped. ``aliases`` maps other names of a field
    (``{"num_experts": "num_local_experts"}``) to it; an alias is read when the field's own name is unset."""
    names = {f.name for f in fields(cls)} - set(exclude)
    kw = {k: v for k, v in d.items() if k in names and v is not None}
    for alias, name in (aliases or {}).items():
        if name not in kw and d.get(alias) is not None:
            kw[name] = d[alias]
    return kw


def require_keys(d: Mapping, keys: Iterable[str], family: str) -> None:
    """One CheckpointError naming every key of ``keys`` that the config dict lacks (or sets to null)."""
    missing = [k for k in keys if d.get(k) is None]
    if missing:
        raise CheckpointError(f"config.json lacks {', '.join(missing)}; is this a {family} config?")


def settle_decoder_config(cfg, family: str) -> None:
    """The ``__post_init__`` checks every decoder config shares. Fills the head defaults of a frozen config
    (``num_key_value_heads``: one per head; ``head_dim``: hidden_size / heads) and checks that the MLP
    activation is SiLU and the query heads share the key/value heads evenly, where the config has them."""
    heads = cfg.num_attention_heads
    if getattr(cfg, "num_key_value_heads", heads) is None:
        object.__setattr__(cfg, "num_key_value_heads", heads)
    if getattr(cfg, "head_dim", 0) is None:
        object.__setattr__(cfg, "head_dim", cfg.hidden_size // heads)
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitectureError(f"{family}: hidden_act {act!r}; only 'silu' is supported")
    kv = getattr(cfg, "num_key_value_heads", heads)
    if heads % kv:
        raise UnsupportedArchitectureError(
            f"{family}: {heads} attention heads are not a multiple of {kv} key/value heads"
        )


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
