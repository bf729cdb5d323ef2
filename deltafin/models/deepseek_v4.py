"""DeepSeek-V4 (``deepseek_v4``): V4-Flash and V4-Pro.

- Attention (``csa.py``): low-rank queries (q_a, a weighted norm, q_b, a per-head unit norm), one 512-wide
  K = V head, partial interleaved RoPE on the last channels (the ``compress`` theta on compressed layers),
  a sliding window beside HCA or CSA compressed entries, per-head sinks, and a grouped low-rank output
  (o_groups blocks of o_a, then o_b).
- mHC: the residual is ``hc_mult`` streams [T, N, D]; per block a projection of the normed streams gives
  pre (collapse the streams into the block's input), post (spread its output) and comb (mix the streams,
  Sinkhorn-normalised to doubly stochastic); a last collapse (``hc_head``) before the final norm.
- MoE: sqrt(softplus) scores, top-k by scores + correction bias, renormalised, times the routed scale;
  ``hash_moe`` layers take their experts from ``tid2eid[token]`` (known before the layer runs:
  ``known_routes``); clamped SwiGLU experts and one shared expert. The MTP layer is not read.

Trunk names are transformers' module names (``families.deepseek_v4`` renames the checkpoint's once).
Legend: T tokens, N streams, D model width, H heads, d head width, G output groups.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltafin import kernels
from deltafin.errors import UnsupportedArchitectureError
from deltafin.models import csa
from deltafin.models.base import (
    ExpertSource,
    SequenceState,
    dense,
    embed_rows,
    linear,
    moe_dispatch,
    rms_norm,
    rowwise,
)
from deltafin.models.common import ROUTER_RENORM_EPS, DecoderLM, config_kwargs, require_tensors
from deltafin.models.layers import GrowingCache
from deltafin.models.rope import Rope, RopeConfig
from deltafin.quant.record import QTensor

MODEL_TYPES = ("deepseek_v4",)
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_A, _C, _I = r"model\.layers\.\d+\.self_attn\.", r"model\.layers\.\d+\.self_attn\.compressor\.", \
    r"model\.layers\.\d+\.self_attn\.compressor\.indexer\."
READS = (
    r"model\.embed_tokens\.weight", r"model\.norm\.weight", r"lm_head\.weight", r"model\.hc_head\.hc_(fn|base|scale)",
    _A + r"(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj)\.weight", _A + r"(q_a_norm|kv_norm)\.weight", _A + "sinks",
    _C + r"(kv_proj|gate_proj|kv_norm)\.weight", _C + "position_bias",
    _I + r"(kv_proj|gate_proj|kv_norm|q_b_proj|scorer\.weights_proj)\.weight", _I + "position_bias",
    r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight",
    r"model\.layers\.\d+\.(attn_hc|ffn_hc)\.(fn|base|scale)",
    r"model\.layers\.\d+\.mlp\.gate\.(weight|e_score_correction_bias|tid2eid)",
    r"model\.layers\.\d+\.mlp\.shared_experts\.(gate|up|down)_proj\.weight",
)
SCORING = ("sqrtsoftplus", "sigmoid")


@dataclass(frozen=True)
class Config:
    """transformers' DeepseekV4Config defaults (DeepSeek-V4-Flash)."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    csa_rate: int = 4
    hca_rate: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    model_type: str = "deepseek_v4"
    rope_main: RopeConfig | None = None
    rope_compress: RopeConfig | None = None

    def __post_init__(self) -> None:
        n, mt = self.num_hidden_layers, self.model_type
        if mt not in MODEL_TYPES:
            raise UnsupportedArchitectureError(f"model_type {mt!r} is not served by deepseek_v4.py")
        if self.num_key_value_heads != 1:
            raise UnsupportedArchitectureError(f"{mt}: num_key_value_heads {self.num_key_value_heads}; the code "
                                               f"implements V4's single shared key/value head")
        if self.scoring_func not in SCORING or self.hidden_act != "silu":
            raise UnsupportedArchitectureError(f"{mt}: scoring_func {self.scoring_func!r} / hidden_act "
                                               f"{self.hidden_act!r}; supported: {', '.join(SCORING)} / silu")
        if len(self.layer_types) != n or set(self.layer_types) - {SLIDING, CSA, HCA}:
            raise UnsupportedArchitectureError(f"{mt}: layer_types must name one of {SLIDING}, {CSA}, {HCA} for "
                                               f"each of {n} layers")
        if len(self.mlp_layer_types) != n or set(self.mlp_layer_types) - {"hash_moe", "moe"}:
            raise UnsupportedArchitectureError(f"{mt}: mlp_layer_types must name hash_moe or moe for each of {n} "
                                               f"layers")
        H, d, G = self.num_attention_heads, self.head_dim, self.o_groups
        if (H * d) % G or self.rope_main.dim > min(d, self.index_head_dim):
            raise UnsupportedArchitectureError(f"{mt}: {H} heads x {d} do not split into {G} output groups, or the "
                                               f"rotary width {self.rope_main.dim} exceeds a head")

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        """From a config.json dict (transformers' names, or the legacy ones it folds in); unknown keys ignored."""
        kw = config_kwargs(cls, d, exclude=("layer_types", "mlp_layer_types", "rope_main", "rope_compress"))
        c = cls.__dataclass_fields__
        n = int(d.get("num_hidden_layers") or c["num_hidden_layers"].default)
        rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **(d.get("compress_rates") or {})}
        kw["csa_rate"] = int(d.get("compress_rate_csa") or rates[CSA])
        kw["hca_rate"] = int(d.get("compress_rate_hca") or rates[HCA])
        kw["layer_types"] = tuple(_layer_types(d, n))
        hashed = d.get("num_hash_layers")
        hashed = 3 if hashed is None else int(hashed)
        kw["mlp_layer_types"] = tuple((d.get("mlp_layer_types") or ["hash_moe"] * min(n, hashed)
                                       + ["moe"] * max(0, n - hashed))[:n])
        kw["rope_main"], kw["rope_compress"] = _ropes(d, int(d.get("head_dim") or c["head_dim"].default),
                                                      int(d.get("max_position_embeddings") or
                                                          c["max_position_embeddings"].default))
        return cls(**kw)

    def rate(self, i: int) -> int:
        return {CSA: self.csa_rate, HCA: self.hca_rate}.get(self.layer_types[i], 0)


def _layer_types(d: dict, n: int) -> list[str]:
    """transformers' rule: explicit layer_types, else the legacy per-layer compress_ratios (0 / 4 / 128), else
    two HCA layers then HCA and CSA alternating."""
    if d.get("layer_types"):
        return list(d["layer_types"])[:n]
    if d.get("compress_ratios"):
        return [{0: SLIDING, 4: CSA, 128: HCA}[r] for r in d["compress_ratios"]][:n]
    return [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]


def _ropes(d: dict, head_dim: int, max_pos: int) -> tuple[RopeConfig, RopeConfig]:
    """(main, compress): plain RoPE at rope_theta for sliding layers; compress_rope_theta, with any YaRN of the
    config (its cos/sin factor 1, as transformers sets it), for compressed layers and their indexer."""
    rp = d.get("rope_parameters") or {}
    factor = d.get("partial_rotary_factor")
    if factor is None:
        factor = d["qk_rope_head_dim"] / head_dim if d.get("qk_rope_head_dim") else 64 / 512
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = dict(rp["main"]), dict(rp["compress"])
    else:
        flat = {k: v for k, v in {**(d.get("rope_scaling") or {}), **rp}.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": d.get("rope_theta", 10000.0)}
        comp = {**flat, "rope_theta": d.get("compress_rope_theta", 160000.0)}
        comp.setdefault("rope_type", comp.pop("type", "default"))
    for p in (main, comp):
        p.setdefault("partial_rotary_factor", factor)
    if comp.get("rope_type") == "yarn":
        comp.setdefault("attention_factor", 1.0)
    return RopeConfig.from_params(main, head_dim, max_pos), RopeConfig.from_params(comp, head_dim, max_pos)


@dataclass
class Streams:
    """The mHC residual of T tokens [T, N, D] and their token ids [T] (hash routing reads them)."""

    x: torch.Tensor
    ids: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.x.shape[0]

    @staticmethod
    def cat(carries: Sequence[Streams]) -> Streams:
        return Streams(torch.cat([c.x for c in carries]), torch.cat([c.ids for c in carries]))

    def split(self, sizes: Sequence[int]) -> list[Streams]:
        return [Streams(x, i) for x, i in zip(self.x.split(list(sizes)), self.ids.split(list(sizes)), strict=True)]


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [T, N, N] (positive) towards doubly stochastic: columns, then (rows, columns) iters - 1 times."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class Model(DecoderLM):
    """The V4 decoder over DecoderLM's weights and head (see ``deltafin.models.base`` for the API)."""

    _glu = None  # clamped SwiGLU: no grouped CUDA kernel; each expert runs through the packed matmuls

    def _setup(self) -> None:
        c, f32 = self.cfg, torch.float32
        need = ["model.hc_head.hc_fn", "model.hc_head.hc_base", "model.hc_head.hc_scale"]
        for i in range(self.num_layers):
            pre = f"model.layers.{i}."
            need += [pre + f"self_attn.{n}.weight" for n in ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj",
                                                             "o_b_proj", "q_a_norm", "kv_norm")]
            need += [pre + n for n in ("self_attn.sinks", "mlp.gate.weight", "attn_hc.fn", "ffn_hc.fn")]
            if c.layer_types[i] != SLIDING:
                need += [pre + "self_attn.compressor.kv_proj.weight", pre + "self_attn.compressor.position_bias"]
            if c.layer_types[i] == CSA:
                need += [pre + "self_attn.compressor.indexer.q_b_proj.weight"]
            if c.mlp_layer_types[i] == "hash_moe":
                need.append(pre + "mlp.gate.tid2eid")
        require_tensors(self.w, need)
        # the float32 pieces (mHC, sinks, position biases, hash tables) once as plain tensors
        for n in list(self.w):
            if n.endswith(("_hc.fn", "_hc.base", "_hc.scale", ".sinks", ".position_bias")) or "hc_head." in n:
                self.w[n] = dense(self.w[n], f32)
        self.tid2eid = {i: dense(self._p(i, "mlp.gate.tid2eid"), f32).long()
                        for i in range(self.num_layers) if c.mlp_layer_types[i] == "hash_moe"}
        self.rope_main = Rope(c.rope_main, device=self.device)
        self.rope_comp = Rope(c.rope_compress, device=self.device)

    # ------------------------------------------------------------------ state and carry

    def new_layer_state(self, i: int, max_len: int) -> csa.V4LayerState:
        c, dev, dt = self.cfg, self.device, self.dtype
        st = csa.V4LayerState(c.sliding_window, torch.empty(0, c.head_dim, device=dev, dtype=dt))
        rate = c.rate(i)
        if rate:
            n = max(1, max_len // rate)
            kind = c.layer_types[i]
            st.main = csa.Compressor(rate, c.head_dim, kind == CSA, GrowingCache((c.head_dim,), n, dev, dt))
            if kind == CSA:
                st.indexer = csa.Compressor(rate, c.index_head_dim, True,
                                            GrowingCache((c.index_head_dim,), n, dev, dt))
        return st

    def embed(self, ids: torch.Tensor) -> Streams:
        ids = ids.to(self.device)
        x = embed_rows(self.embed_w, ids, self.dtype)  # [T, D]
        return Streams(x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous(), ids)

    def known_routes(self, ids: torch.Tensor) -> list[tuple[int, list[int]]]:
        """(layer, expert ids) of the hash-routed layers for tokens ``ids`` [T]: fixed by the token ids, so the
        engine reads them before those layers run."""
        ids = ids.to(self.device)  # a table on the meta device is a layer another device runs (runtime/offload.py)
        return [(i, torch.unique(t[ids]).tolist()) for i, t in self.tid2eid.items() if t.device.type != "meta"]

    # ------------------------------------------------------------------ mHC

    def _hc(self, pre: str, x: torch.Tensor, collapse_only: bool = False):
        """(post [T, N], comb [T, N, N], the collapsed block input [T, D]) of the streams x [T, N, D]."""
        c, (T, N, D) = self.cfg, x.shape
        p = self.w.get
        flat = csa.unit_rms(x.reshape(T, N * D).float(), self.norm_eps)
        with kernels.serial() if flat.device.type == "cpu" else contextlib.nullcontext():
            mix = linear(flat, p(pre + "fn"))  # [T, (2 + N) N] or [T, N]; one thread: the same sums at any -t
        scale, base = p(pre + "scale"), p(pre + "base")
        if collapse_only:
            w_pre = rowwise(torch.sigmoid, mix * scale + base) + c.hc_eps
            return (w_pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
        m_pre, m_post, m_comb = mix.split([N, N, N * N], dim=-1)
        b_pre, b_post, b_comb = base.split([N, N, N * N])
        w_pre = rowwise(torch.sigmoid, m_pre * scale[0] + b_pre) + c.hc_eps  # rowwise: batch-invariant
        post = 2 * rowwise(torch.sigmoid, m_post * scale[1] + b_post)
        comb = torch.softmax(m_comb.view(T, N, N) * scale[2] + b_comb.view(N, N), dim=-1) + c.hc_eps
        comb = sinkhorn(comb, c.hc_sinkhorn_iters, c.hc_eps)
        return post, comb, (w_pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)

    @staticmethod
    def _spread(x: torch.Tensor, post, comb, out: torch.Tensor) -> torch.Tensor:
        """post_n * out + sum_j comb[j, n] x_j: the block output spread over the mixed streams."""
        dt = x.dtype
        return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), x)

    # ------------------------------------------------------------------ the Model API

    def attn_part(self, i: int, carry: Streams, state: SequenceState) -> Streams:
        pre = f"model.layers.{i}."
        post, comb, h = self._hc(pre + "attn_hc.", carry.x)
        h = rms_norm(h, self._p(i, "input_layernorm.weight"), self.norm_eps)
        return Streams(self._spread(carry.x, post, comb, self._attention(i, h, state)), carry.ids)

    def _mlp_input_hc(self, i: int, carry: Streams):
        post, comb, h = self._hc(f"model.layers.{i}.ffn_hc.", carry.x)
        return post, comb, rms_norm(h, self._p(i, "post_attention_layernorm.weight"), self.norm_eps)

    def route(self, i: int, carry: Streams) -> tuple[torch.Tensor, torch.Tensor]:
        return self._route(i, self._mlp_input_hc(i, carry)[2], carry.ids)

    def mlp_part(self, i: int, carry: Streams, experts: ExpertSource) -> Streams:
        post, comb, h = self._mlp_input_hc(i, carry)
        ids, weights = self._route(i, h, carry.ids)  # [T, k]
        y = moe_dispatch(h, ids, weights, i, experts, self._expert, None)
        y = y + self._clamped_swiglu(h, {r: self._p(i, f"mlp.shared_experts.{r}_proj.weight")
                                         for r in ("gate", "up", "down")})
        return Streams(self._spread(carry.x, post, comb, y), carry.ids)

    def head(self, carry: Streams) -> torch.Tensor:
        h = self._hc("model.hc_head.hc_", carry.x, collapse_only=True)  # [T, D]
        return linear(rms_norm(h, self.norm_w, self.norm_eps), self.lm_head).float()  # [T, V]

    def forward(self, ids: torch.Tensor, state: SequenceState, experts: ExpertSource) -> torch.Tensor:
        x = self.embed(ids)
        for i in range(self.num_layers):
            x = self.mlp_part(i, self.attn_part(i, x, state), experts)
        state.pos += ids.shape[0]
        return self.head(x)

    # ------------------------------------------------------------------ MoE

    def _route(self, i: int, h: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """sqrt(softplus) (or sigmoid) scores of float32 logits; top-k with the correction bias, or the hash
        table's experts; weights renormalised and scaled. (ids [T, k], weights [T, k] float32)."""
        c = self.cfg
        logits = linear(h.float(), self._p(i, "mlp.gate.weight"))  # [T, E]
        act = (lambda t: F.softplus(t).sqrt()) if c.scoring_func == "sqrtsoftplus" else torch.sigmoid
        scores = rowwise(act, logits)
        if i in self.tid2eid:
            ids = self.tid2eid[i][tokens]  # [T, k]
        else:
            bias = self._p(i, "mlp.gate.e_score_correction_bias")
            choice = scores if bias is None else scores + dense(bias, torch.float32)
            ids = choice.topk(c.num_experts_per_tok, dim=-1).indices
        w = scores.gather(1, ids)
        return ids, w / (w.sum(-1, keepdim=True) + ROUTER_RENORM_EPS) * c.routed_scaling_factor

    def _clamped_swiglu(self, x: torch.Tensor, t) -> torch.Tensor:
        lim = self.cfg.swiglu_limit
        g = linear(x, t["gate"]).clamp(max=lim)
        u = linear(x, t["up"]).clamp(min=-lim, max=lim)
        return linear(F.silu(g) * u, t["down"])

    def _expert(self, x: torch.Tensor, tensors) -> torch.Tensor:
        return self._clamped_swiglu(x, tensors)

    # ------------------------------------------------------------------ attention

    def _attention(self, i: int, h: torch.Tensor, state: SequenceState) -> torch.Tensor:
        c, (T, _), pos = self.cfg, h.shape, state.pos
        H, d, eps = c.num_attention_heads, c.head_dim, self.norm_eps
        a, st = f"model.layers.{i}.self_attn.", state.layers[i]
        p = self.w.get
        rope = self.rope_main if c.layer_types[i] == SLIDING else self.rope_comp
        cos, sin = rope.cos_sin(pos, T)  # [T, r/2]
        q_res = rms_norm(linear(h, p(a + "q_a_proj.weight")), p(a + "q_a_norm.weight"), eps)  # [T, q_lora]
        q = csa.unit_rms(linear(q_res, p(a + "q_b_proj.weight")).view(T, H, d), eps)
        q = csa.rope_tail(q, cos, sin)  # [T, H, d]
        kv = csa.rope_tail(rms_norm(linear(h, p(a + "kv_proj.weight")), p(a + "kv_norm.weight"), eps), cos, sin)
        keys, first = csa.window_keys(st, kv, pos)  # [S, d]
        comp, keep = self._compressed(i, h, q_res, st, pos)
        if comp is not None and keep is not None and T == 1:  # decode: read only the chosen entries
            comp, keep = comp[keep[0]], None
        o = csa.attend(q, keys, first, pos, c.sliding_window, comp, keep, p(a + "sinks"), d**-0.5)
        o = csa.rope_tail(o, cos, -sin)  # the values' rotation undone at the query's position
        return self._grouped_out(i, o.reshape(T, H * d))

    def _compressed(self, i: int, h, q_res, st: csa.V4LayerState, pos: int):
        """(entries [N, d], keep-mask [T, N]) of a compressed layer after this call's tokens; (None, None) for a
        sliding layer. HCA keeps the finished windows; CSA the indexer's choice among them."""
        if st.main is None:
            return None, None
        c, T, a = self.cfg, h.shape[0], f"model.layers.{i}.self_attn.compressor."
        self._feed(a, h, st.main)
        comp = st.main.entries.rows()
        if st.indexer is None:
            return comp, (csa.finished(pos, T, st.main.rate, h.device)[:, None] >
                          torch.arange(comp.shape[0], device=h.device)[None]) if T > 1 else None
        x = a + "indexer."
        self._feed(x, h, st.indexer)
        cos, sin = self.rope_comp.cos_sin(pos, T)
        Hi, Di = c.index_n_heads, c.index_head_dim
        qi = csa.rope_tail(linear(q_res, self.w[x + "q_b_proj.weight"]).view(T, Hi, Di), cos, sin)
        wts = linear(h, self.w[x + "scorer.weights_proj.weight"]).float() * Hi**-0.5  # [T, Hi]
        st.keep = csa.index_select(qi, wts, st.indexer.entries.rows(), pos, st.main.rate, c.index_topk)
        return comp, st.keep

    def _feed(self, pre: str, h: torch.Tensor, comp: csa.Compressor) -> None:
        p = self.w.get
        kv, gate = linear(h, p(pre + "kv_proj.weight")), linear(h, p(pre + "gate_proj.weight"))
        csa.compress(comp, kv, gate, p(pre + "position_bias"), p(pre + "kv_norm.weight"), self.norm_eps,
                     self.rope_comp)

    def _grouped_out(self, i: int, o: torch.Tensor) -> torch.Tensor:
        """o_b(concat_g o_a[g] o[:, g]) for o [T, H d] in G groups of H d / G channels."""
        c, T = self.cfg, o.shape[0]
        G, r = c.o_groups, c.o_lora_rank
        w = self._p(i, "self_attn.o_a_proj.weight")  # [G r, H d / G]
        parts = o.view(T, G, -1)
        y = torch.cat([linear(parts[:, g], _rows(w, g * r, (g + 1) * r)) for g in range(G)], dim=-1)  # [T, G r]
        return linear(y, self._p(i, "self_attn.o_b_proj.weight"))


def _rows(w: QTensor | torch.Tensor, a: int, b: int) -> QTensor | torch.Tensor:
    """Rows a..b-1 of a weight record (every format keeps its scales per row)."""
    if isinstance(w, torch.Tensor):
        return w[a:b]
    return QTensor(w.format, (b - a, *w.shape[1:]), w.data[a:b], None if w.scale is None else w.scale[a:b])
