"""The GQA families' trunk math in MLX (qwen3_moe, mixtral, olmoe, gpt_oss), behind the Model API of ``models.base``.

The carry is an MLX array [T, D] (``MXCarry``, which ``runtime.batch`` concatenates and splits); ids come in and
logits go out as torch tensors, the step between is MLX: ``mx.fast.rms_norm``, ``mx.fast.rope`` (the family's
inverse frequencies from ``models.rope``), ``mx.fast.scaled_dot_product_attention`` over a growing KV cache,
the router on the device with one host synchronisation per MoE layer (the top k on the host, as the expert source
needs the ids there), the routed experts by ``gather_qmm`` over the slab's slots (``kernels.mlx.glu``), their sum
over the k slots in slot order, and ``mx.async_eval`` of each layer's output so the device runs while the next
layer's graph is built. Configs and checkpoint names are the torch families' (``models.registry``).
"""

from __future__ import annotations

import numpy as np
import torch

from deltafin.errors import UnsupportedArchitectureError
from deltafin.kernels import mlx as km
from deltafin.models import registry
from deltafin.models.base import SequenceState, forward_parts
from deltafin.models.common import GQA_LAYER, QK_NORMS, take
from deltafin.models.rope import Rope
from deltafin.quant.record import QTensor

FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3", "kimi_k3", "kimi_k25", "glm4_moe",
            "minimax_m2", "deepseek_v32", "qwen3_next", "qwen3_5_moe", "deepseek_v4")
_ROUTERS = {"qwen3_moe": ("mlp.gate.weight",), "olmoe": ("mlp.gate.weight",),
            "mixtral": ("block_sparse_moe.gate.weight", "mlp.gate.weight"), "gpt_oss": ("mlp.router.weight",),
            "deepseek_v3": ("mlp.gate.weight",), "kimi_k25": ("mlp.gate.weight",),
            "deepseek_v32": ("mlp.gate.weight",)}
_DENSE = {"gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"}


class MXCarry:
    """The residual stream [T, D] as an MLX array, with the ``cat``/``split`` that ``runtime.batch`` uses."""

    def __init__(self, x):
        self.x = x

    @classmethod
    def cat(cls, carries: list[MXCarry]) -> MXCarry:
        return cls(km.mx().concatenate([c.x for c in carries]))

    def split(self, sizes) -> list[MXCarry]:
        cuts = np.cumsum(list(sizes))[:-1].tolist()
        return [MXCarry(p) for p in km.mx().split(self.x, cuts)]


class MXKVCache:
    """Keys and values [1, Hkv, capacity, d] of one layer, doubling when full; ``values=False`` keeps keys alone
    (MLA's latent rows); ``dv``: values of another width than the keys (DSA's indexer keys)."""

    def __init__(self, hkv: int, d: int, max_len: int, dtype, values: bool = True, dv: int | None = None):
        m = km.mx()
        self.max_len, self.length = max_len, 0
        self.k = m.zeros((1, hkv, min(64, max_len), d), dtype=dtype)
        self.v = m.zeros((1, hkv, self.k.shape[2], dv or d), dtype=dtype) if values else None

    def update(self, k, v, pos: int):
        m = km.mx()
        end = pos + k.shape[2]
        assert pos <= self.length and end <= self.max_len, (pos, self.length, end, self.max_len)
        if end > self.k.shape[2]:
            cap = min(max(2 * self.k.shape[2], end), self.max_len)
            pad = [(0, 0), (0, 0), (0, cap - self.k.shape[2]), (0, 0)]
            self.k = m.pad(self.k, pad)
            self.v = None if self.v is None else m.pad(self.v, pad)
        self.k[:, :, pos:end, :] = k
        if self.v is not None:
            self.v[:, :, pos:end, :] = v
        self.length = end
        return self.k[:, :, :end, :], None if self.v is None else self.v[:, :, :end, :]


def _causal_window(pos: int, T: int, S: int, window: int | None):
    """The boolean mask [T, S] of keys each query sees: causal, within the last ``window`` positions."""
    q = np.arange(pos, pos + T)[:, None]
    kpos = np.arange(S)[None, :]
    ok = kpos <= q
    if window is not None:
        ok &= kpos > q - window
    return km.mx().array(ok)


class MLXDecoder:
    """Legend: T tokens, D width, H query heads, Hkv key/value heads, d head width, E experts, k per token."""

    def __init__(self, family: str, text_config: dict, weights: dict, exact: bool, dtype: str = "auto"):
        """``exact``: float32 activations and every weight decoded to float32 (the reference's math); else the
        stored formats through MLX's quantized kernels with ``dtype`` activations (auto: bfloat16)."""
        if family not in FAMILIES:
            raise UnsupportedArchitectureError(f"--device mlx runs {', '.join(FAMILIES)} so far, not {family}; use "
                                               "--device cpu for it")
        m = km.mx()
        self.family, self.cfg = family, registry.module_for(family).Config.from_dict(text_config)
        c = self.cfg
        # auto: bfloat16 on the GPU; float32 on MLX's CPU build, whose quantized kernels accumulate bfloat16 inputs in
        # bfloat16 (1.6% of the largest output off on an MXFP4 512 x 2048 matrix), as the torch CPU path does
        gpu = m.default_device().type == m.DeviceType.gpu
        self.dtype = m.float32 if exact or dtype == "f32" or (dtype == "auto" and not gpu) else m.bfloat16
        self.exact = exact
        self.num_layers, self.vocab_size, self.eps = c.num_hidden_layers, c.vocab_size, c.rms_norm_eps
        self.H, self.Hkv, self.d = c.num_attention_heads, getattr(c, "num_key_value_heads", 0), getattr(c, "head_dim", 0)
        self._setup_rope()
        top = take(weights, "", {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight",
                                 "lm_head": "lm_head.weight"}, optional=("lm_head",))
        self.embed_q, self.embed_s = self._embedding(top["embed"])
        self.norm = self._vec(top["norm"])
        tied = getattr(c, "tie_word_embeddings", False) or top["lm_head"] is None
        self.lm_head = self._mat(top["embed"] if tied else top["lm_head"])
        self.layers = [self._layer(weights, i) for i in range(self.num_layers)]

    def _setup_rope(self) -> None:
        """The rotated width, YaRN's factor and the inverse frequencies of the family's RoPE."""
        c = self.cfg
        rope = Rope(c.rope, self.d, getattr(c, "max_position_embeddings", None))
        self.rope_dims, self.rope_factor = rope.dim, rope.factor
        self.freqs = km.mx().array((1.0 / rope.inv_freq.double()).float().numpy())

    # ------------------------------------------------------------------ weights
    def _mat(self, rec) -> km.MXWeight:
        if self.exact:  # the float32 reference's weights, decoded once
            return km.prepare(_plain(rec), km.mx().float32)
        return km.prepare(rec, self.dtype)

    def _vec(self, rec):
        return None if rec is None else km.dense_array(_plain(rec), km.mx().float32)

    def _embedding(self, rec):
        m = km.mx()
        if isinstance(rec, QTensor) and rec.format == "int8":  # rows decoded as they are looked up
            return m.array(rec.data.numpy()), m.array(rec.scale.float().numpy())
        return km.dense_array(_plain(rec), m.float32), None

    def _is_moe(self, i: int) -> bool:
        c = self.cfg
        return c.is_moe(i) if hasattr(c, "is_moe") else True

    def _window(self, i: int) -> int | None:
        c = self.cfg
        return c.window(i) if hasattr(c, "window") else getattr(c, "sliding_window", None)

    def _attn_weights(self, weights: dict, p: str) -> dict:
        """A layer's norms and attention records (``p`` its checkpoint prefix) as MLX arrays."""
        names = dict(GQA_LAYER)
        if self._has_qk_norms():
            names |= QK_NORMS
        lw = take(weights, p, names, optional=("q_b", "k_b", "v_b", "o_b", "qn", "kn"))
        out = {n: self._mat(lw[n]) for n in ("q", "k", "v", "o")}
        return out | {n: self._vec(lw.get(n)) for n in ("ln1", "ln2", "q_b", "k_b", "v_b", "o_b", "qn", "kn")}

    def _has_qk_norms(self) -> bool:
        return self.family in ("qwen3_moe", "olmoe")

    def _layer(self, weights: dict, i: int) -> dict:
        p = f"model.layers.{i}."
        out = self._attn_weights(weights, p)
        if self._is_moe(i):
            router = next((weights[p + n] for n in _ROUTERS[self.family] if weights.get(p + n) is not None), None)
            if router is None:
                take(weights, p, {"router": _ROUTERS[self.family][0]})  # names the missing tensor
            out["router"] = km.prepare(_plain(router), km.mx().float32)  # routing in float32, as the reference
            out["router_b"] = self._vec(weights.get(p + "mlp.router.bias"))
        else:
            out |= {n: self._mat(r) for n, r in take(weights, p, _DENSE).items()}
        if self.family == "gpt_oss":
            out["sinks"] = self._vec(take(weights, p, {"sinks": "self_attn.sinks"})["sinks"])
        return out

    # ------------------------------------------------------------------ the Model API
    def new_state(self, max_len: int) -> SequenceState:
        return SequenceState([MXKVCache(self.Hkv, self.d, max_len, self.dtype) for _ in range(self.num_layers)])

    def embed(self, ids: torch.Tensor) -> MXCarry:
        m = km.mx()
        idx = m.array(ids.cpu().numpy().astype(np.int32))
        rows = m.take(self.embed_q, idx, axis=0).astype(m.float32)
        if self.embed_s is not None:
            rows = rows * m.take(self.embed_s, idx, axis=0)[:, None]
        return MXCarry(rows.astype(self.dtype))

    def attn_part(self, i: int, carry: MXCarry, state: SequenceState) -> MXCarry:
        m, lw = km.mx(), self.layers[i]
        h = m.fast.rms_norm(carry.x, lw["ln1"].astype(carry.x.dtype), self.eps)
        return MXCarry(carry.x + self._attention(i, h, state))

    def _qkv(self, i: int, h):
        """q [T, H, d], k and v [T, Hkv, d] of the normed stream h [T, D], with the family's q/k norms."""
        m, lw, T = km.mx(), self.layers[i], h.shape[0]
        q, k, v = (km.linear(h, lw[n], lw[f"{n}_b"]) for n in ("q", "k", "v"))  # [T, H d], [T, Hkv d] x2
        if self.family == "olmoe":  # q/k norms over the full width, then the optional clip
            q, k = self._qk_norm(lw, q, k)
            clip = getattr(self.cfg, "clip_qkv", None)
            if clip is not None:
                q, k, v = (m.clip(t, -clip, clip) for t in (q, k, v))
        q, k, v = q.reshape(T, self.H, self.d), k.reshape(T, self.Hkv, self.d), v.reshape(T, self.Hkv, self.d)
        return self._qk_norm(lw, q, k) + (v,) if self.family == "qwen3_moe" else (q, k, v)  # qwen3: per head

    def _qk_norm(self, lw: dict, q, k):
        m = km.mx()
        return m.fast.rms_norm(q, lw["qn"].astype(q.dtype), self.eps), m.fast.rms_norm(k, lw["kn"].astype(k.dtype),
                                                                                      self.eps)

    def _attention(self, i: int, h, state: SequenceState):
        m, lw, T = km.mx(), self.layers[i], h.shape[0]
        H, d = self.H, self.d
        q, k, v = (m.transpose(t, (1, 0, 2))[None] for t in self._qkv(i, h))  # [1, H|Hkv, T, d]
        q, k = self._rope(q, state.pos), self._rope(k, state.pos)
        K, V = state.layers[i].update(k, v, state.pos)  # [1, Hkv, S, d]
        window, S = self._window(i), K.shape[2]
        mask = None if T == 1 and (window is None or S <= window) else \
            "causal" if window is None or S <= window else _causal_window(state.pos, T, S, window)
        sinks = lw.get("sinks")  # gpt-oss: a learned logit per head beside the keys
        o = m.fast.scaled_dot_product_attention(q, K, V, scale=d**-0.5, mask=mask,
                                                sinks=None if sinks is None else sinks.astype(q.dtype))
        o = m.transpose(o[0], (1, 0, 2)).reshape(T, H * d)
        return km.linear(o, lw["o"], lw["o_b"])  # [T, D]

    def _rope(self, x, pos: int):
        m = km.mx()
        y = m.fast.rope(x, self.rope_dims, traditional=False, base=None, scale=1.0, offset=pos, freqs=self.freqs)
        if self.rope_factor != 1.0:  # YaRN's cos/sin factor, on the rotated channels only
            r = self.rope_dims
            y = m.concatenate([y[..., :r] * self.rope_factor, y[..., r:]], axis=-1)
        return y

    def route(self, i: int, carry: MXCarry):
        if not self._is_moe(i):
            return None
        ids, w = self._router(i, self._mlp_input(i, carry))
        return torch.from_numpy(ids), torch.from_numpy(w)

    def _mlp_input(self, i: int, carry: MXCarry):
        m = km.mx()
        return m.fast.rms_norm(carry.x, self.layers[i]["ln2"].astype(carry.x.dtype), self.eps)

    def _router(self, i: int, x) -> tuple[np.ndarray, np.ndarray]:
        """Softmax over the experts in float32 on the device, its top k on the host (the layer's one
        synchronisation): (ids [T, k] int64, weights [T, k] float32), ids by descending weight."""
        m, c, lw = km.mx(), self.cfg, self.layers[i]
        logits = km.linear(x.astype(m.float32), lw["router"], lw["router_b"])  # [T, E]
        k = c.num_experts_per_tok
        if self.family == "gpt_oss":  # the top k of the logits, softmax over those
            lg = np.array(logits)
            ids = np.argsort(-lg, axis=-1, kind="stable")[:, :k]
            w = np.exp(np.take_along_axis(lg, ids, -1) - np.take_along_axis(lg, ids[:, :1], -1))
            return ids.astype(np.int64), (w / w.sum(-1, keepdims=True)).astype(np.float32)
        probs = np.array(m.softmax(logits, axis=-1))  # [T, E]
        ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
        w = np.take_along_axis(probs, ids, axis=-1)
        if self.family == "mixtral" or getattr(c, "norm_topk_prob", False):
            w = w / w.sum(-1, keepdims=True)
        return ids.astype(np.int64), w.astype(np.float32)

    def mlp_part(self, i: int, carry: MXCarry, experts) -> MXCarry:
        m, lw = km.mx(), self.layers[i]
        x = self._mlp_input(i, carry)
        if not self._is_moe(i):
            y = self._swiglu(lw, "", x)
        else:
            ids, w = self._router(i, x)
            wanted = sorted(set(ids.reshape(-1).tolist()))
            slot_of, views = experts.slots(i, wanted)
            idx = m.array(np.vectorize(slot_of.__getitem__, otypes=[np.uint32])(ids))  # [T, k] slots
            ys = self._gpt_oss_experts(x, views, idx) if self.family == "gpt_oss" else km.glu(x, views, idx)
            y = (ys * m.array(w)[:, :, None].astype(ys.dtype)).sum(axis=1)  # slot order: fixed
            experts.mlx_slab.fence(y)  # the slots read here are free once y is computed
            side = self._moe_side(i, x)
            y = y if side is None else y + side.astype(y.dtype)
        out = carry.x + y.astype(carry.x.dtype)
        m.async_eval(out)
        return MXCarry(out)

    def _swiglu(self, lw: dict, prefix: str, x, act: tuple = ("silu",)):
        """down(act(gate x, up x)) over a layer's records ``{prefix}gate/up/down`` (SwiGLU unless ``act``)."""
        g, u = km.linear(x, lw[prefix + "gate"]), km.linear(x, lw[prefix + "up"])
        return km.linear(km.activation(g, u, act), lw[prefix + "down"])

    def _moe_side(self, i: int, x):
        """What a MoE layer adds beside its routed experts (shared experts), or None."""
        return None

    def _gpt_oss_experts(self, x, roles: dict, idx):
        """gpt-oss' experts: interleaved gate/up rows with biases, the clamped SwiGLU, a biased down -> [T, k, D]."""
        m, c = km.mx(), self.cfg
        gu = km.gather_linear(x[:, None, None, :], roles["gate_up"], idx) + km.slot_rows(roles, "gate_up_bias", idx, x)
        gate, up = m.minimum(gu[..., 0::2], c.swiglu_limit), m.clip(gu[..., 1::2], -c.swiglu_limit, c.swiglu_limit)
        h = (up + 1) * (gate * m.sigmoid(gate * c.swiglu_alpha))
        y = km.gather_linear(h, roles["down"], idx) + km.slot_rows(roles, "down_bias", idx, x)
        return m.squeeze(y, 2)

    def head(self, carry: MXCarry) -> torch.Tensor:
        m = km.mx()
        h = m.fast.rms_norm(carry.x, self.norm.astype(carry.x.dtype), self.eps)
        return torch.from_numpy(np.array(km.linear(h, self.lm_head).astype(m.float32)))  # [T, V]

    def forward(self, ids: torch.Tensor, state: SequenceState, experts) -> torch.Tensor:
        return forward_parts(self, ids, state, experts)  # [T, V]


def _plain(rec):
    """A record as float32 (torch) where the caller wants it decoded; torch tensors pass through."""
    from deltafin.models.base import dense

    return rec if isinstance(rec, torch.Tensor) or rec is None else dense(rec, torch.float32)
