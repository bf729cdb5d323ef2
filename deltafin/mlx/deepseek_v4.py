"""DeepSeek-V4 (``deepseek_v4``) in MLX: the torch model's math (``models.deepseek_v4``, ``models.csa``) on MLX
arrays.

The carry is the mHC residual of ``hc_mult`` streams [T, N, D] with the token ids (hash routing reads them); each
block collapses the streams into its input and spreads its output over the Sinkhorn-mixed streams. Attention has
one K = V head: a sliding window of the layer's own keys and, on compressed layers, the pooled entries of HCA (every
finished window) or CSA (the lightning indexer's top k), in one ``mx.fast.scaled_dot_product_attention`` call with
a boolean mask and each head's sink; interleaved RoPE on the last channels (cos/sin from the torch ``Rope``, at the
compressed entries' own positions too), undone on the output. Routed experts (clamped SwiGLU) by ``gather_qmm``
over the slab's slots; the router's scores and top k on the host as the torch model computes them.
Legend: T tokens, N streams, D width, H heads, d head width, W window, C compressed entries, G output groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from deltafin.kernels import mlx as km
from deltafin.mlx.model import MLXDecoder, _plain
from deltafin.models import csa
from deltafin.models.base import SequenceState
from deltafin.models.common import ROUTER_RENORM_EPS, take
from deltafin.models.deepseek_v4 import CSA, SLIDING, _rows
from deltafin.models.rope import Rope

_ATTN = {n: f"self_attn.{n}.weight" for n in ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj")}
_NORMS = {"ln1": "input_layernorm.weight", "ln2": "post_attention_layernorm.weight",
          "q_a_norm": "self_attn.q_a_norm.weight", "kv_norm": "self_attn.kv_norm.weight", "sinks": "self_attn.sinks"}
_HC = {f"{b}_{n}": f"{b}_hc.{n}" for b in ("attn", "ffn") for n in ("fn", "base", "scale")}
_COMP = {"kv_proj": "kv_proj.weight", "gate_proj": "gate_proj.weight", "kv_norm": "kv_norm.weight",
         "bias": "position_bias"}
_SHARED = {f"shared_{n}": f"mlp.shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")}


class V4Carry:
    """The mHC streams x [T, N, D] (MLX) and their token ids [T] (torch, on the host)."""

    def __init__(self, x, ids: torch.Tensor):
        self.x, self.ids = x, ids

    @classmethod
    def cat(cls, carries: list[V4Carry]) -> V4Carry:
        return cls(km.mx().concatenate([c.x for c in carries]), torch.cat([c.ids for c in carries]))

    def split(self, sizes) -> list[V4Carry]:
        cuts = np.cumsum(list(sizes))[:-1].tolist()
        ids = self.ids.split(list(sizes))
        return [V4Carry(x, i) for x, i in zip(km.mx().split(self.x, cuts), ids, strict=True)]


@dataclass
class MXCompressor:
    """One compressor's running state (``csa.Compressor``): the unfinished window's kv/gate, the last window's
    first-half slots (CSA's overlap) and the entries so far [C, d]."""

    rate: int
    width: int
    overlap: bool
    entries: object
    buf_kv: object = None
    buf_gate: object = None
    prev_kv: object = None
    prev_gate: object = None


@dataclass
class MXV4State:
    """One layer's state: the last W-1 keys [<= W-1, d] and the compressors of a compressed layer."""

    win: object
    main: MXCompressor | None = None
    indexer: MXCompressor | None = None


class MLXDeepSeekV4(MLXDecoder):
    """Legend: T tokens, N streams, D width, H heads, d head width, Hi / Di indexer heads / width."""

    def __init__(self, family: str, text_config: dict, weights: dict, exact: bool, dtype: str = "auto"):
        super().__init__(family, text_config, weights, exact, dtype)
        hc = take(weights, "model.hc_head.", {n: f"hc_{n}" for n in ("fn", "base", "scale")})
        self.hc_head = {n: self._vec(r) for n, r in hc.items()}

    def _setup_rope(self) -> None:
        c = self.cfg
        self.rope_main, self.rope_comp = Rope(c.rope_main), Rope(c.rope_compress)

    # ------------------------------------------------------------------ weights
    def _layer(self, weights: dict, i: int) -> dict:
        c, p = self.cfg, f"model.layers.{i}."
        out = {n: self._mat(r) for n, r in take(weights, p, _ATTN).items()}
        out |= {n: self._vec(r) for n, r in take(weights, p, _NORMS | _HC).items()}
        o_a, r = take(weights, p, {"o_a": "self_attn.o_a_proj.weight"})["o_a"], c.o_lora_rank
        out["o_a"] = [self._mat(_rows(o_a, g * r, (g + 1) * r)) for g in range(c.o_groups)]  # one per group
        if c.layer_types[i] != SLIDING:
            out["comp"] = self._compressor_weights(weights, p + "self_attn.compressor.")
        if c.layer_types[i] == CSA:
            x = p + "self_attn.compressor.indexer."
            out["index"] = self._compressor_weights(weights, x) | {
                n: self._mat(w) for n, w in take(weights, x, {"q_b": "q_b_proj.weight",
                                                              "w": "scorer.weights_proj.weight"}).items()}
        moe = take(weights, p, {"router": "mlp.gate.weight", "bias": "mlp.gate.e_score_correction_bias"},
                   optional=("bias",))
        out["router"] = km.prepare(_plain(moe["router"]), km.mx().float32)  # routing in float32, as the reference
        out["bias"] = None if moe["bias"] is None else _plain(moe["bias"]).float()
        if c.mlp_layer_types[i] == "hash_moe":
            out["tid2eid"] = _plain(take(weights, p, {"t": "mlp.gate.tid2eid"})["t"]).long()
        return out | {n: self._mat(w) for n, w in take(weights, p, _SHARED).items()}

    def _compressor_weights(self, weights: dict, p: str) -> dict:
        lw = take(weights, p, _COMP)
        return {"kv_proj": self._mat(lw["kv_proj"]), "gate_proj": self._mat(lw["gate_proj"]),
                "kv_norm": self._vec(lw["kv_norm"]), "bias": self._vec(lw["bias"])}

    # ------------------------------------------------------------------ state and carry
    def new_state(self, max_len: int) -> SequenceState:
        c, m = self.cfg, km.mx()
        layers = []
        for i in range(self.num_layers):
            st = MXV4State(m.zeros((0, c.head_dim), dtype=self.dtype))
            rate = c.rate(i)
            if rate:
                st.main = MXCompressor(rate, c.head_dim, c.layer_types[i] == CSA,
                                       m.zeros((0, c.head_dim), dtype=self.dtype))
            if c.layer_types[i] == CSA:
                st.indexer = MXCompressor(rate, c.index_head_dim, True, m.zeros((0, c.index_head_dim), dtype=self.dtype))
            layers.append(st)
        return SequenceState(layers)

    def embed(self, ids: torch.Tensor) -> V4Carry:
        m, x = km.mx(), super().embed(ids).x  # [T, D]
        return V4Carry(m.broadcast_to(x[:, None, :], (x.shape[0], self.cfg.hc_mult, x.shape[1])), ids.cpu())

    # ------------------------------------------------------------------ mHC
    def _hc(self, w: dict, pre: str, x, collapse_only: bool = False):
        """(post [T, N], comb [T, N, N], the collapsed block input [T, D]) of the streams x [T, N, D]."""
        m, c, (T, N, D) = km.mx(), self.cfg, x.shape
        flat = _unit_rms(x.reshape(T, N * D).astype(m.float32), self.eps)
        mix = flat @ w[pre + "fn"].T  # [T, (2 + N) N] or [T, N]
        scale, base = w[pre + "scale"], w[pre + "base"]
        if collapse_only:
            w_pre = m.sigmoid(mix * scale + base) + c.hc_eps
            return (w_pre[..., None] * x).sum(axis=1).astype(x.dtype)
        w_pre = m.sigmoid(mix[:, :N] * scale[0] + base[:N]) + c.hc_eps
        post = 2 * m.sigmoid(mix[:, N : 2 * N] * scale[1] + base[N : 2 * N])
        comb = m.softmax(mix[:, 2 * N :].reshape(T, N, N) * scale[2] + base[2 * N :].reshape(N, N), axis=-1) + c.hc_eps
        comb = comb / (comb.sum(axis=-2, keepdims=True) + c.hc_eps)  # Sinkhorn: columns, then rows and columns
        for _ in range(c.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(axis=-1, keepdims=True) + c.hc_eps)
            comb = comb / (comb.sum(axis=-2, keepdims=True) + c.hc_eps)
        return post, comb, (w_pre[..., None] * x).sum(axis=1).astype(x.dtype)

    @staticmethod
    def _spread(x, post, comb, out):
        """post_n out + sum_j comb[j, n] x_j: the block output spread over the mixed streams -> [T, N, D]."""
        m, dt = km.mx(), x.dtype
        return post.astype(dt)[..., None] * out[:, None, :] + m.swapaxes(comb.astype(dt), -1, -2) @ x

    # ------------------------------------------------------------------ the Model API
    def attn_part(self, i: int, carry: V4Carry, state: SequenceState) -> V4Carry:
        m, lw = km.mx(), self.layers[i]
        post, comb, h = self._hc(lw, "attn_", carry.x)
        h = m.fast.rms_norm(h, lw["ln1"].astype(h.dtype), self.eps)
        return V4Carry(self._spread(carry.x, post, comb, self._attention(i, h, state)), carry.ids)

    def _mlp_input_hc(self, i: int, carry: V4Carry):
        m, lw = km.mx(), self.layers[i]
        post, comb, h = self._hc(lw, "ffn_", carry.x)
        return post, comb, m.fast.rms_norm(h, lw["ln2"].astype(h.dtype), self.eps)

    def route(self, i: int, carry: V4Carry):
        ids, w = self._route(i, self._mlp_input_hc(i, carry)[2], carry.ids)
        return torch.from_numpy(ids), torch.from_numpy(w)

    def mlp_part(self, i: int, carry: V4Carry, experts) -> V4Carry:
        m, lw = km.mx(), self.layers[i]
        post, comb, h = self._mlp_input_hc(i, carry)
        ids, w = self._route(i, h, carry.ids)
        slot_of, views = experts.slots(i, sorted(set(ids.reshape(-1).tolist())))
        idx = m.array(np.vectorize(slot_of.__getitem__, otypes=[np.uint32])(ids))  # [T, k] slots
        ys = self._clamped_experts(h, views, idx)  # [T, k, D]
        y = (ys * m.array(w)[:, :, None].astype(ys.dtype)).sum(axis=1)  # slot order: fixed
        experts.mlx_slab.fence(y)  # the slots read here are free once y is computed
        y = y + self._clamped_swiglu(lw, h).astype(y.dtype)
        out = self._spread(carry.x, post, comb, y.astype(carry.x.dtype))
        m.async_eval(out)
        return V4Carry(out, carry.ids)

    def head(self, carry: V4Carry) -> torch.Tensor:
        m = km.mx()
        h = self._hc(self.hc_head, "", carry.x, collapse_only=True)  # [T, D]
        h = m.fast.rms_norm(h, self.norm.astype(h.dtype), self.eps)
        return torch.from_numpy(np.array(km.linear(h, self.lm_head).astype(m.float32)))  # [T, V]

    # ------------------------------------------------------------------ MoE
    def _route(self, i: int, h, tokens: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """The torch model's scores (sqrt softplus or sigmoid) of the device's float32 logits, on the host: top k
        with the correction bias, or the hash table's experts; renormalised, scaled. (ids [T, k], w [T, k])."""
        m, c, lw = km.mx(), self.cfg, self.layers[i]
        logits = torch.from_numpy(np.array(km.linear(h.astype(m.float32), lw["router"])))  # [T, E]
        scores = F.softplus(logits).sqrt() if c.scoring_func == "sqrtsoftplus" else torch.sigmoid(logits)
        if "tid2eid" in lw:
            ids = lw["tid2eid"][tokens]  # [T, k]
        else:
            choice = scores if lw["bias"] is None else scores + lw["bias"]
            ids = choice.topk(c.num_experts_per_tok, dim=-1).indices
        w = scores.gather(1, ids)
        w = w / (w.sum(-1, keepdim=True) + ROUTER_RENORM_EPS) * c.routed_scaling_factor
        return ids.numpy().astype(np.int64), w.numpy().astype(np.float32)

    def _clamp(self, g, u):
        m, lim = km.mx(), self.cfg.swiglu_limit
        g, u = m.minimum(g, lim), m.clip(u, -lim, lim)
        return g * m.sigmoid(g) * u

    def _clamped_experts(self, x, roles: dict, idx):
        """The routed experts' clamped SwiGLU over the slab's slots: x [T, D], idx [T, k] -> [T, k, D]."""
        m, xe = km.mx(), x[:, None, None, :]
        h = self._clamp(km.gather_linear(xe, roles["gate"], idx), km.gather_linear(xe, roles["up"], idx))
        return m.squeeze(km.gather_linear(h, roles["down"], idx), 2)

    def _clamped_swiglu(self, lw: dict, x):
        h = self._clamp(km.linear(x, lw["shared_gate"]), km.linear(x, lw["shared_up"]))
        return km.linear(h, lw["shared_down"])

    # ------------------------------------------------------------------ attention
    def _attention(self, i: int, h, state: SequenceState):
        m, c, lw, T, pos = km.mx(), self.cfg, self.layers[i], h.shape[0], state.pos
        H, d, eps, st = c.num_attention_heads, c.head_dim, self.eps, state.layers[i]
        cs = _cos_sin(self.rope_main if c.layer_types[i] == SLIDING else self.rope_comp, torch.arange(pos, pos + T))
        q_res = m.fast.rms_norm(km.linear(h, lw["q_a_proj"]), lw["q_a_norm"].astype(h.dtype), eps)  # [T, q_lora]
        q = _rope_tail(_unit_rms(km.linear(q_res, lw["q_b_proj"]).reshape(T, H, d), eps), *cs)  # [T, H, d]
        kv = _rope_tail(m.fast.rms_norm(km.linear(h, lw["kv_proj"]), lw["kv_norm"].astype(h.dtype), eps), *cs)
        full = m.concatenate([st.win, kv])  # [S, d]: the window's keys, then these
        st.win = full[max(0, full.shape[0] - (c.sliding_window - 1)) :]
        first, S = pos + T - full.shape[0], full.shape[0]
        qi, kj = np.arange(pos, pos + T)[:, None], np.arange(first, first + S)[None]
        keep = m.array((kj <= qi) & (kj > qi - c.sliding_window))  # [T, S]
        comp, comp_keep = self._compressed(i, h, q_res, st, pos)
        if comp is not None and comp.shape[0]:
            full = m.concatenate([full, comp])
            keep = m.concatenate([keep, comp_keep], axis=1)
        qh, kvh = m.transpose(q, (1, 0, 2))[None], full[None, None]  # [1, H, T, d], [1, 1, S + C, d]
        o = m.fast.scaled_dot_product_attention(qh, kvh, kvh, scale=d**-0.5, mask=keep,
                                                sinks=lw["sinks"].astype(qh.dtype))
        o = _rope_tail(m.transpose(o[0], (1, 0, 2)), cs[0], -cs[1])  # the values' rotation undone
        return self._grouped_out(lw, o.reshape(T, H * d))

    def _compressed(self, i: int, h, q_res, st: MXV4State, pos: int):
        """(entries [C, d], keep-mask [T, C]) of a compressed layer after this call's tokens; (None, None) for a
        sliding layer. HCA keeps the finished windows; CSA the indexer's choice among them."""
        if st.main is None:
            return None, None
        m, c, lw, T = km.mx(), self.cfg, self.layers[i], h.shape[0]
        self._feed(lw["comp"], h, st.main)
        comp, C = st.main.entries, st.main.entries.shape[0]
        seen = (np.arange(pos, pos + T) + 1) // st.main.rate  # [T] entries each query has finished
        if st.indexer is None:
            return comp, m.array(seen[:, None] > np.arange(C)[None])
        ix = lw["index"]
        self._feed(ix, h, st.indexer)
        Hi, Di = c.index_n_heads, c.index_head_dim
        cs = _cos_sin(self.rope_comp, torch.arange(pos, pos + T))
        qi = _rope_tail(km.linear(q_res, ix["q_b"]).reshape(T, Hi, Di), *cs).astype(m.float32)
        wts = km.linear(h, ix["w"]).astype(m.float32) * Hi**-0.5  # [T, Hi]
        keys = st.indexer.entries.astype(m.float32)  # [C, Di]
        scores = m.maximum(m.transpose(qi, (1, 0, 2)) @ keys.T, 0) * Di**-0.5  # [Hi, T, C]
        index = (scores * m.transpose(wts, (1, 0))[:, :, None]).sum(0)  # [T, C]
        later = m.array(np.arange(C)[None] >= seen[:, None])
        k = min(c.index_topk, C)
        if k == 0:
            return comp, ~later
        top = m.argpartition(-m.where(later, -float("inf"), index), kth=k - 1, axis=-1)[:, :k]  # [T, k]
        chosen = m.put_along_axis(m.zeros((T, C), dtype=m.bool_), top, m.array(True), axis=-1)
        return comp, chosen & ~later

    def _feed(self, w: dict, h, st: MXCompressor) -> None:
        """``csa.compress``: pool every window of ``rate`` tokens this call finishes into an entry (CSA: window
        w's second half-channels with window w-1's first half), normed and rotated at its position."""
        m = km.mx()
        kv, gate = km.linear(h, w["kv_proj"]), km.linear(h, w["gate_proj"])
        if st.buf_kv is not None:
            kv, gate = m.concatenate([st.buf_kv, kv]), m.concatenate([st.buf_gate, gate])
        R, d = st.rate, st.width
        n = kv.shape[0] // R
        st.buf_kv, st.buf_gate = kv[n * R :], gate[n * R :]
        if n == 0:
            return
        ck = kv[: n * R].reshape(n, R, -1)  # [n, R, c]
        cg = gate[: n * R].reshape(n, R, -1) + w["bias"].astype(gate.dtype)
        if st.overlap:  # entry w: window w-1's first half (zeros / -inf before the first), then window w's second
            first_kv = m.zeros((1, R, d), dtype=ck.dtype) if st.prev_kv is None else st.prev_kv[None]
            first_g = m.full((1, R, d), -float("inf"), dtype=cg.dtype) if st.prev_gate is None else st.prev_gate[None]
            st.prev_kv, st.prev_gate = ck[-1, :, :d], cg[-1, :, :d]
            ck = m.concatenate([m.concatenate([first_kv, ck[:-1, :, :d]]), ck[..., d:]], axis=1)  # [n, 2R, d]
            cg = m.concatenate([m.concatenate([first_g, cg[:-1, :, :d]]), cg[..., d:]], axis=1)
        pooled = (ck * m.softmax(cg.astype(m.float32), axis=1).astype(ck.dtype)).sum(axis=1)  # [n, d]
        pooled = m.fast.rms_norm(pooled, w["kv_norm"].astype(pooled.dtype), self.eps)
        count = st.entries.shape[0]
        cs = csa.cos_sin_at(self.rope_comp, torch.arange(count, count + n) * R)
        st.entries = m.concatenate([st.entries, _rope_tail(pooled, *(km.mx().array(t.numpy()) for t in cs))])

    def _grouped_out(self, lw: dict, o):
        """o_b(concat_g o_a[g] o[:, g]) for o [T, H d] in G groups of H d / G channels."""
        m, T, G = km.mx(), o.shape[0], self.cfg.o_groups
        parts = o.reshape(T, G, -1)
        y = m.concatenate([km.linear(parts[:, g], lw["o_a"][g]) for g in range(G)], axis=-1)  # [T, G r]
        return km.linear(y, lw["o_b_proj"])


def _cos_sin(rope: Rope, positions: torch.Tensor):
    """The torch ``Rope``'s cos, sin [T, r/2] (its factor included) at ``positions``, as MLX arrays."""
    return tuple(km.mx().array(t.numpy()) for t in csa.cos_sin_at(rope, positions))


def _rope_tail(x, cos, sin):
    """``csa.rope_tail``: interleaved RoPE on the last r = 2 cos.shape[-1] channels of x [T, ..., d] (pairs
    (2i, 2i+1) in place), in float32; cos/sin [T, r/2]."""
    m, r = km.mx(), 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (r // 2,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    rot = x[..., -r:].astype(m.float32)
    even, odd = rot[..., 0::2], rot[..., 1::2]
    turned = m.stack([even * c - odd * s, odd * c + even * s], axis=-1).reshape(rot.shape)
    return m.concatenate([x[..., :-r], turned.astype(x.dtype)], axis=-1)


def _unit_rms(x, eps: float):
    """RMS norm without a weight over the last dim (the per-head query norm; mHC's stream norm)."""
    m = km.mx()
    xf = x.astype(m.float32)
    return x * m.rsqrt((xf * xf).mean(-1, keepdims=True) + eps).astype(x.dtype)
