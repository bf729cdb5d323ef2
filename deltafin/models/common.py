"""Pieces shared by the model families: SwiGLU experts, softmax and sigmoid top-k routing, config and weight
helpers, and the decoder body. RoPE is in ``rope.py``, caches and attention in ``layers.py``.

Stable API for every family module:

- ``swiglu_expert(x, tensors)``, ``softmax_topk(logits, k, renormalize)``, ``sigmoid_topk(...)``.
- ``config_kwargs(cls, d, exclude, aliases)``: the known, non-null fields of an HF config dict;
  ``require_keys(d, keys, family)``; ``settle_decoder_config(cfg, family)``: head defaults and checks.
- ``take(weights, prefix, names)``, ``require_tensors(weights, names)``: one clear error for missing records.
- ``DecoderConfig``: ``from_dict`` and ``__post_init__`` of the plain decoder configs.
- ``DecoderLM``: the Model API over per-family parts; ``GQADecoder``: with RoPE'd GQA over a KV cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields

import torch
import torch.nn.functional as F

from deltafin.errors import CheckpointError, UnsupportedArchitectureError
from deltafin.kernels import (
    fast_enabled,
    glu_into,
    gqa_one,
    gqa_table,
    invariant_enabled,
    moe_sum_one,
    route_one,
)
from deltafin.kernels import swiglu as fused_swiglu
from deltafin.models.base import (
    ExpertSource,
    SequenceState,
    Weights,
    dense,
    embed_rows,
    expert_groups,
    forward_parts,
    ids_to_host_during,
    linear,
    linears,
    moe_dispatch,
    rms_norm,
    rowwise,
    settle,
    unique_ids,
)
from deltafin.models.layers import KVCache, self_attention
from deltafin.models.rope import Rope, rope_parameters
from deltafin.quant.record import QTensor

# Trunk names every decoder reads (a family's ``READS`` adds its own; ``store.plan.unused_trunk`` refuses the rest)
READS_TOP = (
    r"model\.(embed_tokens|norm)\.weight",
    r"lm_head\.weight",
    r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight",
)
READS_GQA = (r"model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj\.(weight|bias)",)
READS_QK_NORM = (r"model\.layers\.\d+\.self_attn\.(q|k)_norm\.weight",)

# ------------------------------------------------------------------------------------------- MLP / MoE


def swiglu_expert(x: torch.Tensor, tensors: Mapping[str, QTensor | torch.Tensor]) -> torch.Tensor:
    """down(silu(gate x) * up x) for x [n, D] and records gate/up [I, D], down [D, I]. Returns [n, D]."""
    y = fused_swiglu(x, tensors["gate"], tensors["up"], tensors["down"])  # None off the fast path
    if y is not None:
        return y
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


ROUTER_RENORM_EPS = 1e-20  # DeepSeek-V3 and K3 spec §3.4 step 1: w_k = s_k / (sum s + 1e-20)


def sigmoid_topk(
    logits: torch.Tensor,
    bias: QTensor | torch.Tensor | None,
    k: int,
    renormalize: bool,
    scaling: float,
    n_group: int = 1,
    topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing (also Kimi K2/K3): sigmoid scores of float32 logits [T, E]; the correction bias
    [E] only picks the experts, among those of the best ``topk_group`` of ``n_group`` groups; the weights
    are the unbiased scores of the chosen ones, optionally renormalised, times ``scaling``.
    Returns (ids [T, k] long, weights [T, k] float32)."""
    scores = rowwise(torch.sigmoid, logits)  # [T, E]
    choice = scores if bias is None else scores + dense(bias, torch.float32)  # selection only
    ids = _group_limited(choice, n_group, topk_group).topk(k, dim=-1).indices
    w = scores.gather(1, ids)  # [T, k]
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + ROUTER_RENORM_EPS)
    return ids, w * scaling


def _group_limited(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """choice [T, E] with experts outside the best topk_group groups set to -inf; a group's score is
    the sum of its two best experts."""
    if topk_group >= n_group:
        return choice
    T, E = choice.shape
    per = E // n_group
    groups = choice.view(T, n_group, per).topk(min(2, per), dim=-1).values.sum(-1)  # [T, G]
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(1, groups.topk(topk_group, dim=-1).indices, True)
    return choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))


# ---------------------------------------------------------------------------------------- configs


def config_kwargs(
    cls, d: Mapping, exclude: Iterable[str] = (), aliases: Mapping[str, str] | None = None
) -> dict:
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


class DecoderConfig:
    """Base of the qwen3_moe, mixtral and olmoe config dataclasses. ``from_dict`` reads the known, non-null
    fields (``ALIASES``: other names of a field), the rope settings (``ROPE_THETA``: the family's default
    theta) and ``_extra(d)``; ``__post_init__`` is ``settle_decoder_config``."""

    __slots__ = ()
    FAMILY = ""
    ALIASES: Mapping[str, str] = {}
    ROPE_THETA = 10000.0

    def __post_init__(self) -> None:
        settle_decoder_config(self, self.FAMILY)

    @classmethod
    def from_dict(cls, d: Mapping):
        """From a config.json dict; unknown keys are ignored."""
        kw = config_kwargs(cls, d, aliases=cls.ALIASES)
        kw.update(rope=rope_parameters(d, cls.ROPE_THETA), **cls._extra(d))
        return cls(**kw)

    @classmethod
    def _extra(cls, d: Mapping) -> dict:
        """Fields that need more than a copy from the config dict."""
        return {}


# ---------------------------------------------------------------------------------------- weights


def require_tensors(weights: Mapping, names: Iterable[str]) -> None:
    """One CheckpointError naming the tensors of ``names`` that the packed trunk lacks."""
    missing = [n for n in names if weights.get(n) is None]
    if missing:
        raise CheckpointError(
            f"the packed trunk lacks {len(missing)} tensor(s) the config needs, e.g. {missing[:3]}; the model "
            f"was packed from another architecture or checkpoint, or is incomplete: repack it"
        )


def take(weights: Weights, prefix: str, names: Mapping[str, str], optional: tuple[str, ...] = ()) -> dict:
    """{short: weights[prefix + name]} for every entry of ``names``; optional ones may be absent (None).
    Raises one CheckpointError naming the missing required tensors."""
    require_tensors(weights, [prefix + n for s, n in names.items() if s not in optional])
    return {short: weights.get(prefix + name) for short, name in names.items()}


# ---------------------------------------------------------------------------------------- decoder body


class DecoderLM:
    """The decoder body every family shares (Model API and ``route`` contract: ``deltafin.models.base``).

    Holds the weights on the device, embeds, runs the layer loop and the head (final norm + lm_head).
    The carry is the residual stream [T, D]: ``attn_part`` adds ``_attention`` of the input-normed stream,
    ``mlp_part`` adds ``_moe`` (``_router`` + ``_expert`` through ``moe_dispatch``) or ``_dense_mlp`` of the
    post-attention-normed one (``_mlp_input``). A family prepares in ``_setup`` and implements
    ``new_layer_state``, ``_attention`` and ``_router``; Kimi K3 overrides the carry-specific parts.
    """

    def __init__(
        self, cfg, weights: Weights, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.num_layers, self.vocab_size = cfg.num_hidden_layers, cfg.vocab_size
        self.norm_eps = cfg.rms_norm_eps
        # records on the meta device stand in for layers another device runs (runtime/offload.py): kept as they are
        self.w: dict[str, QTensor | torch.Tensor] = {
            n: t if t.data.device.type == "meta" else t.to(self.device) for n, t in weights.items()
        }
        top = take(
            self.w,
            "",
            {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"},
            optional=("lm_head",),
        )
        self.embed_w, self.norm_w = top["embed"], top["norm"]
        tied = getattr(cfg, "tie_word_embeddings", False)
        self.lm_head = top["embed"] if tied or top["lm_head"] is None else top["lm_head"]
        self._setup()

    def _setup(self) -> None:
        """Family-specific preparation once the weights are on the device (checks, per-layer records)."""

    def _p(self, i: int, name: str) -> QTensor | torch.Tensor | None:
        """Layer i's record ``name`` (checkpoint name after ``model.layers.{i}.``), None when absent."""
        return self.w.get(f"model.layers.{i}.{name}")

    # ------------------------------------------------------------------ the Model API

    def new_layer_state(self, i: int, max_len: int):
        raise NotImplementedError

    def new_state(self, max_len: int) -> SequenceState:
        return SequenceState([self.new_layer_state(i, max_len) for i in range(self.num_layers)])

    def embed(self, ids: torch.Tensor):
        return embed_rows(self.embed_w, ids.to(self.device), self.dtype)  # [T, D]

    def attn_part(self, i: int, carry, state: SequenceState):
        h = rms_norm(carry, self._p(i, "input_layernorm.weight"), self.norm_eps)  # [T, D]
        return carry + self._attention(i, h, state)

    def mlp_part(self, i: int, carry, experts: ExpertSource):
        return carry + self._mlp(i, self._mlp_input(i, carry), experts)

    def route(self, i: int, carry) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The experts ``mlp_part(i, carry, ...)`` fetches: (ids [T, k] long, weights [T, k] float32), or
        None for a dense layer. ``carry`` is mlp_part's input; the pre-MLP norm is applied here."""
        return self._router(i, self._mlp_input(i, carry)) if self._is_moe(i) else None

    def guess_experts(self, i: int, carry) -> list[int]:
        """A guess of the experts layer i will fetch, from an earlier layer's stream ``carry`` (after its attention):
        layer i's router on it, as if it were layer i's input. The stream changes little from one layer to the next,
        so the guess is mostly right; a source reads its misses ahead (``runtime.source.StreamingExperts.guess``).
        [] for a dense layer. Nothing is computed from it."""
        r = self.route(i, carry)
        return [] if r is None else unique_ids(r[0].cpu())

    def head(self, carry) -> torch.Tensor:
        h = rms_norm(carry, self.norm_w, self.norm_eps)  # [T, D]
        return linear(h, self.lm_head).float()  # [T, V]

    def forward(self, ids: torch.Tensor, state: SequenceState, experts: ExpertSource) -> torch.Tensor:
        return forward_parts(self, ids, state, experts)  # [T, V]

    # ------------------------------------------------------------------ the parts a family fills in

    def _attention(self, i: int, h: torch.Tensor, state: SequenceState) -> torch.Tensor:
        """Layer i's attention output [T, D] for the normed stream h [T, D] at positions state.pos.."""
        raise NotImplementedError

    def _is_moe(self, i: int) -> bool:
        return True

    def _router(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's router on its normed MLP input x [T, D]: (ids [T, k], weights [T, k] float32)."""
        raise NotImplementedError

    def _mlp_input(self, i: int, carry) -> torch.Tensor:
        return rms_norm(carry, self._p(i, "post_attention_layernorm.weight"), self.norm_eps)  # [T, D]

    def _mlp(self, i: int, x: torch.Tensor, experts: ExpertSource) -> torch.Tensor:
        return self._moe(i, x, experts) if self._is_moe(i) else self._dense_mlp(i, x)

    def _moe(self, i: int, x: torch.Tensor, experts: ExpertSource) -> torch.Tensor:
        ids, weights = self._router(i, x)  # [T, k]
        ids_host, side = ids_to_host_during(ids, lambda: self._moe_side(i, x))
        y = moe_dispatch(x, ids, weights, i, experts, self._expert, self._glu, ids_host)  # [T, D]
        return y if side is None else y + side

    def _moe_side(self, i: int, x: torch.Tensor) -> torch.Tensor | None:
        """What a MoE layer adds to its routed experts that does not depend on routing (shared experts), queued
        on the device while the router's ids travel to the host; None where there is none."""
        return None

    _glu: tuple | None = ("silu",)  # the routed experts' activation, for the grouped CUDA kernels

    def _expert(self, x: torch.Tensor, tensors) -> torch.Tensor:
        return swiglu_expert(x, tensors)

    def _dense_mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self._swiglu(i, "mlp.", x)

    def _swiglu(self, i: int, prefix: str, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU over layer i's records ``{prefix}gate_proj/up_proj/down_proj``."""
        return swiglu_expert(x, {r: self._p(i, f"{prefix}{r}_proj.weight") for r in ("gate", "up", "down")})


GQA_LAYER = {
    "ln1": "input_layernorm.weight",
    "ln2": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "q_b": "self_attn.q_proj.bias",
    "k_b": "self_attn.k_proj.bias",
    "v_b": "self_attn.v_proj.bias",
    "o_b": "self_attn.o_proj.bias",
}
QK_NORMS = {"qn": "self_attn.q_norm.weight", "kn": "self_attn.k_norm.weight"}


class GQADecoder(DecoderLM):
    """DecoderLM with RoPE'd grouped-query attention over one KVCache per layer (qwen3_moe, mixtral, olmoe,
    gpt_oss): q/k/v/o projections with optional biases; ``_qkv`` may norm or clip the projections,
    ``_window`` and ``_sinks`` give a layer's sliding window and attention sinks. ``self.layers[i]`` holds
    layer i's records by short name: ``GQA_LAYER`` plus the family's ``_layer_names(i)``."""

    OPTIONAL = ("q_b", "k_b", "v_b", "o_b")  # short names that may be absent

    def _setup(self) -> None:
        c = self.cfg
        self.rope = Rope(c.rope, c.head_dim, getattr(c, "max_position_embeddings", None), self.device)
        self.layers = [
            take(self.w, f"model.layers.{i}.", GQA_LAYER | self._layer_names(i), optional=self.OPTIONAL)
            for i in range(self.num_layers)
        ]

    def _layer_names(self, i: int) -> dict[str, str]:
        return {}

    def attn_part(self, i: int, carry, state: SequenceState):
        if carry.shape[0] == 1 and fast_enabled():
            y = self._attn_one(i, carry, state)
            if y is not None:
                return y
        return super().attn_part(i, carry, state)

    def mlp_part(self, i: int, carry, experts: ExpertSource):
        # batch-invariant: a token's routing must be the one it gets among others, which the batched torch router gives
        if carry.shape[0] == 1 and fast_enabled() and not invariant_enabled():
            y = self._moe_one(i, carry, experts)
            if y is not None:
                return y
        return super().mlp_part(i, carry, experts)

    def guess_experts(self, i: int, carry) -> list[int]:
        spec = self._spec(i) if carry.shape[0] == 1 and fast_enabled() and self._is_moe(i) else None
        if spec is not None:
            ln, router, k, renorm = spec
            got = route_one(carry, ln, self.norm_eps, router, k, renorm)
            if got is not None:  # the compiled routing of one token (_moe_one's)
                return sorted(got[1])
        return super().guess_experts(i, carry)

    def _spec(self, i: int) -> tuple | None:
        """Layer i's ``_route_spec``, made once."""
        specs = self.__dict__.setdefault("_route_specs", {})
        if i not in specs:
            specs[i] = self._route_spec(i)
        return specs[i]

    def _router_one(self, i: int) -> tuple | None:
        """(router record [E, D], k, renormalise) where layer i's routing is a softmax top-k over plain logits and the
        layer adds nothing beside its routed experts (no shared expert): what the one-token fused MoE step does.
        None (the default): another routing, which keeps the layer-by-layer calls."""
        return None

    def _moe_one(self, i: int, x: torch.Tensor, experts: ExpertSource) -> torch.Tensor | None:
        """x + layer i's routed experts for one token with their host work in compiled calls: the norm and routing
        in one (``kernels.route_one``), each group of experts the source hands over in one (``glu_into``, each
        expert's own result bit for bit), their weighted sum in slot order in one (``moe_sum_one``), so the result
        does not depend on which experts were cached or the order reads land. None where it does not apply."""
        spec = self._spec(i)
        if spec is None:
            return None
        ln, router, k, renorm = spec
        got = route_one(x, ln, self.norm_eps, router, k, renorm)
        if got is None:
            return None
        h, ids, w = got
        split = hasattr(experts, "combine")  # ranks (runtime/distributed.py): moe_dispatch's protocol, same numbers
        if hasattr(experts, "agree"):
            ids_t, w = experts.agree(i, torch.tensor([ids]), w[None])
            ids, w = ids_t[0].tolist(), w[0]
        y = torch.zeros(k, x.shape[1]) if split else torch.empty(k, x.shape[1])  # a slot another rank fills reads 0
        slot_of = {e: s for s, e in enumerate(ids)}
        wanted = sorted(slot_of)
        if hasattr(experts, "local"):
            wanted = experts.local(i, wanted)
        groups = (expert_groups(experts, i, wanted) if hasattr(experts, "fetch_groups")
                  else ([item] for item in experts.fetch(i, wanted)))
        seen = 0
        for group in groups:
            self._glu_slots(h, group, [slot_of[e] for e, _ in group], y)
            for e, tensors in settle(group):  # a copy failed its check: a good copy's result
                self._glu_slots(h, [(e, tensors)], [slot_of[e]], y)
            seen += len(group)
        assert seen == len(wanted), f"expert source returned {seen} of {len(wanted)} experts for layer {i}"
        if split:
            y = experts.combine(i, y[None], torch.tensor([ids]))[0]
        return moe_sum_one(x, y, w)

    def _glu_slots(self, h: torch.Tensor, group: list, slots: list[int], y: torch.Tensor) -> None:
        """y[slots[j]] = group[j]'s expert on h, in one call where ``glu_into`` takes them."""
        if not glu_into(h, [t for _, t in group], slots, y, self._glu):
            for (_, tensors), s in zip(group, slots, strict=True):
                y[s] = self._expert(h, tensors)[0]

    def _route_spec(self, i: int) -> tuple | None:
        r = self._router_one(i) if self._is_moe(i) and self.device.type == "cpu" and self.dtype == torch.float32 else None
        if r is None:
            return None
        rec, k, renorm = r
        w = rec if isinstance(rec, torch.Tensor) else rec.data if getattr(rec, "format", None) == "f32" else None
        if w is None or w.dtype != torch.float32 or w.dim() != 2 or w.device.type != "cpu":
            return None
        return dense(self._p(i, "post_attention_layernorm.weight"), torch.float32).contiguous(), w.contiguous(), k, renorm

    def _qk_norms(self, i: int) -> tuple | None:
        """The per-head q and k RMSNorm weights this family's ``_qkv`` applies ((None, None): none), or None where its
        ``_qkv`` does something else, which the one-token fused block does not do."""
        return (None, None) if type(self)._qkv is GQADecoder._qkv else None

    def _attn_one(self, i: int, x: torch.Tensor, state: SequenceState) -> torch.Tensor | None:
        """x + layer i's attention of one token in one compiled call (``kernels.gqa_one``: the separate calls'
        result, bit for bit), or None where it does not apply (the layer-by-layer calls run)."""
        tables = self.__dict__.setdefault("_gqa_tables", {})
        if i not in tables:
            tables[i] = self._gqa_table(i)
        t = tables[i]
        cache = state.layers[i]
        if t is None or state.at is not None or not isinstance(cache, KVCache):
            return None
        pos, window = state.pos, self._window(i)
        cos, sin = self.rope.cos_sin(pos, 1) if self.rope.dim else (None, None)
        kbuf, vbuf = cache.keys.reserve(pos, 1), cache.values.reserve(pos, 1)  # the call writes position pos
        k0 = 0 if window is None else max(0, pos - window + 1)
        return gqa_one(t, x, self.norm_eps, self.cfg.head_dim**-0.5, pos, cos, sin, kbuf, vbuf, k0)

    def _gqa_table(self, i: int):
        c, lw = self.cfg, self.layers[i]
        norms = self._qk_norms(i)
        if (norms is None or self._sinks(i) is not None or self.device.type != "cpu" or self.dtype != torch.float32
                or c.num_key_value_heads * c.head_dim != getattr(lw["k"], "shape", (0,))[0]):
            return None
        dense_or_none = [None if t is None else dense(t, torch.float32) for t in (lw["q_b"], lw["k_b"], lw["v_b"], lw["o_b"])]
        return gqa_table("cpu", c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         self.rope.dim, dense(lw["ln1"], torch.float32), lw["q"], lw["k"], lw["v"], lw["o"],
                         dense_or_none, tuple(None if n is None else dense(n, torch.float32) for n in norms))

    def new_layer_state(self, i: int, max_len: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_key_value_heads, c.head_dim, c.head_dim, max_len, self.device, self.dtype)

    def _attention(self, i: int, h: torch.Tensor, state: SequenceState) -> torch.Tensor:
        c, T, lw = self.cfg, h.shape[0], self.layers[i]
        q, k, v = self._qkv(i, h)
        q = q.view(T, c.num_attention_heads, c.head_dim)  # [T, H, d]
        k = k.view(T, c.num_key_value_heads, c.head_dim)  # [T, Hkv, d]
        v = v.view(T, c.num_key_value_heads, c.head_dim)  # [T, Hkv, d]
        scale = c.head_dim**-0.5
        o = self_attention(
            q, k, v, self.rope, state.layers[i], state.pos, scale, self._window(i), self._sinks(i)
        )
        return linear(o, lw["o"], lw["o_b"])  # [T, D]

    def _qkv(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H*d], k and v [T, Hkv*d] (or already split into heads) for the normed stream h [T, D]."""
        lw = self.layers[i]
        q, k, v = linears(h, (lw["q"], lw["k"], lw["v"]), (lw["q_b"], lw["k_b"], lw["v_b"]))
        return q, k, v

    def _window(self, i: int) -> int | None:
        return getattr(self.cfg, "sliding_window", None)

    def _sinks(self, i: int) -> torch.Tensor | None:
        return None
