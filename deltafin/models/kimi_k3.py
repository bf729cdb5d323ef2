"""Kimi K3 (model_type kimi_k3, text model kimi_linear): KDA + gated NoPE MLA, AttnRes, Stable LatentMoE.

Follows ../shared/specs/KIMI_K3.md (section numbers below refer to it). Letters: T tokens, D model width,
k experts per token, E experts, Lat latent width (routed_expert_hidden_size).

The residual stream is AttnRes (§3.3): a running partial sum ``p`` plus block snapshots, mixed per token
by a softmax before each sublayer. ``Carry`` holds both for T tokens; the runtime may concatenate the
carries of several sequences along T for the token-wise parts (``mlp_part``, ``head``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from deltafin.errors import CheckpointError, UnsupportedArchitectureError
from deltafin.kernels import cuda as kc
from deltafin.kernels import glu as fused_glu
from deltafin.models import kda, mla
from deltafin.models.base import (
    ExpertSource,
    ExpertTensors,
    SequenceState,
    dense,
    ids_to_host_during,
    linear,
    moe_dispatch,
    rms_norm,
    rowwise,
    stack_rows,
)
from deltafin.models.common import READS_TOP, ROUTER_RENORM_EPS, DecoderLM, require_tensors, sigmoid_topk
from deltafin.models.layers import GrowingCache

# §6.2 disagreement 2: the official module declares A_log [num_heads], the checkpoint stores it zero-padded
# to 128 entries, fla indexes it per head and sglang slices the first num_heads. We read entries
# [A_LOG_FIRST_HEAD, A_LOG_FIRST_HEAD + num_heads), one per head, broadcast over the head's channels.
A_LOG_FIRST_HEAD = 0
READS = (  # trunk names the model reads (``store.plan.unused_trunk``)
    *READS_TOP,
    r"model\.output_attn_res_(norm|proj)\.weight",
    r"model\.layers\.\d+\.(self_attention_res|mlp_res)_(norm|proj)\.weight",
    r"model\.layers\.\d+\.self_attn\.(q|k|v|o|g|b|f_a|f_b|q_a|q_b|kv_a|kv_b)_proj(_with_mqa)?\.(weight|bias)",
    r"model\.layers\.\d+\.self_attn\.((q|k|v)_conv1d\.weight|A_log|dt_bias)",
    r"model\.layers\.\d+\.self_attn\.(o_norm|q_a_layernorm|kv_a_layernorm)\.weight",
    r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight",
    r"model\.layers\.\d+\.block_sparse_moe\.(gate\.weight|gate\.e_score_correction_bias)",
    r"model\.layers\.\d+\.block_sparse_moe\.(routed_expert_(down_proj|up_proj|norm)|shared_experts\.(gate|up|down)_proj)"
    r"\.weight",
)


@dataclass(frozen=True, slots=True)
class Config:
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    intermediate_size: int  # the dense layer-0 MLP
    num_attention_heads: int  # MLA
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kda_num_heads: int
    kda_head_dim: int
    kda_layers: tuple[int, ...]  # 1-based, as in config.json (§1.1 layer schedule)
    full_attn_layers: tuple[int, ...]  # 1-based MLA layers
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int
    attn_res_block_size: int
    short_conv_kernel_size: int = 4
    gate_lower_bound: float = -5.0
    num_shared_experts: int = 0
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    rms_norm_eps: float = 1e-5
    mla_use_output_gate: bool = True
    latent_moe_use_norm: bool = True
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    _kda: frozenset[int] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        kda_l, mla_l = set(self.kda_layers), set(self.full_attn_layers)
        if kda_l & mla_l or kda_l | mla_l != set(range(1, n + 1)):
            raise UnsupportedArchitectureError(
                f"kimi_k3: kda_layers and full_attn_layers must split layers 1..{n} between them; got "
                f"kda {sorted(kda_l)}, full {sorted(mla_l)}"
            )
        if self.attn_res_block_size <= 0:
            raise UnsupportedArchitectureError(f"kimi_k3: attn_res_block_size must be positive, got {self.attn_res_block_size}")
        object.__setattr__(self, "_kda", frozenset(i - 1 for i in kda_l))

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        """From the text_config dict (or the top-level config holding it); unknown keys are ignored."""
        d = d.get("text_config", d)
        _check_supported(d)
        la = d["linear_attn_config"]
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d and not f.name.startswith("_")}
        kw.update(
            kda_num_heads=la["num_heads"], kda_head_dim=la["head_dim"],
            kda_layers=tuple(la["kda_layers"]), full_attn_layers=tuple(la["full_attn_layers"]),
            short_conv_kernel_size=la.get("short_conv_kernel_size", 4),
            gate_lower_bound=la.get("gate_lower_bound", -5.0),
        )
        return cls(**kw)

    def is_kda(self, i: int) -> bool:
        return i in self._kda

    def is_moe(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0


def _check_supported(d: dict) -> None:
    la = d.get("linear_attn_config") or {}
    wants = {
        "hidden_act": (d.get("hidden_act"), "situ"),
        "moe_router_activation_func": (d.get("moe_router_activation_func", "sigmoid"), "sigmoid"),
        "num_expert_group": (d.get("num_expert_group", 1), 1),
        "mla_use_nope": (d.get("mla_use_nope", True), True),
        "linear_attn_config.use_full_rank_gate": (la.get("use_full_rank_gate", True), True),
        "attn_res_block_size set": (d.get("attn_res_block_size") is not None, True),
        "latent MoE (routed_expert_hidden_size set)": (d.get("routed_expert_hidden_size") is not None, True),
    }
    bad = [f"{k}={got!r} (need {need!r})" for k, (got, need) in wants.items() if got != need]
    if bad:
        raise UnsupportedArchitectureError(f"kimi_k3: this config differs from Kimi K3 in {', '.join(bad)}")


@dataclass(frozen=True, slots=True)
class Carry:
    """AttnRes stream of T tokens: the running partial sum and the block snapshots (token-major)."""

    p: torch.Tensor  # [T, D]
    blocks: tuple[torch.Tensor, ...] = ()  # each [T, D]; blocks[0] is the embedding

    @property
    def tokens(self) -> int:
        return self.p.shape[0]

    @staticmethod
    def cat(carries: Sequence[Carry]) -> Carry:
        """Concatenate the carries of several sequences (at the same layer) along T."""
        n = {len(c.blocks) for c in carries}
        assert len(n) == 1, f"carries at different layers ({sorted(n)} snapshots)"
        blocks = tuple(torch.cat(b) for b in zip(*(c.blocks for c in carries), strict=True))
        return Carry(torch.cat([c.p for c in carries]), blocks)

    def split(self, sizes: Sequence[int]) -> list[Carry]:
        """Inverse of :meth:`cat`: one carry per sequence length in ``sizes``."""
        ps = self.p.split(list(sizes))
        bs = [b.split(list(sizes)) for b in self.blocks]
        return [Carry(p, tuple(b[j] for b in bs)) for j, p in enumerate(ps)]


def attn_res_mix(p: torch.Tensor, blocks: Sequence[torch.Tensor], w: torch.Tensor, eps: float) -> torch.Tensor:
    """Mix(p, B) of §3.3: softmax over [b_0..b_{n-1}, p] of RMS-normalised keys . w, applied to the raw entries.

    p [T, D], blocks each [T, D], w [D] = res_norm.weight * res_proj.weight (fp32). Computed in fp32.
    """
    V = torch.stack([*blocks, p]).float()  # [n+1, T, D]
    # row by row (a per-row rsqrt, dot product and softmax): each token's mix whatever tokens share the call
    n1, T = V.shape[:2]
    inv = rowwise(torch.rsqrt, (V.pow(2).mean(-1) + eps).reshape(-1, 1)).view(n1, T, 1)
    pi = (V * inv).mul_(w).sum(-1).T.softmax(-1).T  # [n+1, T]; one temporary of V's size
    return (pi.unsqueeze(-1) * V).sum(0).to(p.dtype)


def mix_norm(p: torch.Tensor, blocks: Sequence[torch.Tensor], w: torch.Tensor, norm_w, eps: float) -> torch.Tensor:
    """rms_norm(Mix(p, blocks), norm_w) (Mix = p itself without blocks): one fused launch on the bf16 kernel
    path, the torch forms otherwise (float32 stays the exact reference)."""
    if kc.enabled(p):
        y = kc.mix_norm(torch.stack([*blocks, p]), w, dense(norm_w, torch.float32), eps, eps)
        if y is not None:
            return y
    return rms_norm(attn_res_mix(p, blocks, w, eps) if blocks else p, norm_w, eps)


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-GLU (§3.4): beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta), in fp32."""
    if kc.enabled(g):
        y = kc.situ_glu(g, u, beta, linear_beta)
        if y is not None:
            return y
    gf, uf = g.float(), u.float()
    act = beta * torch.tanh(gf / beta) * torch.sigmoid(gf) * (linear_beta * torch.tanh(uf / linear_beta))
    return act.to(g.dtype)


@dataclass(frozen=True, slots=True)
class Routed:
    """A latent MoE layer's routing decision (``Model.moe_begin``) and the input it was made on."""

    ids: torch.Tensor  # [T, k] long: the chosen experts
    weights: torch.Tensor  # [T, k] float32: their routing weights (scaling factor included)
    x: torch.Tensor  # [T, D]: the normed MLP input


_KDA_NAMES = ("q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj", "f_b_proj",
              "b_proj", "g_proj", "o_norm", "o_proj")
_MLA_NAMES = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
_MOE_NAMES = ("gate.weight", "gate.e_score_correction_bias", "routed_expert_down_proj.weight",
              "routed_expert_up_proj.weight")


class Model(DecoderLM):
    """Kimi K3 over packed trunk records; routed experts come from an ExpertSource. The carry is a ``Carry``."""

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        self.kda_chunk = kda.CHUNK
        self._stacked: dict[str, tuple] | None = None  # stack_decode_projections
        self._check()
        self.vec = self._vectors()

    def _check(self) -> None:
        need = ["lm_head.weight", "model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight"]
        for i in range(self.num_layers):
            pre = f"model.layers.{i}."
            need += [pre + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                       "self_attention_res_norm.weight", "self_attention_res_proj.weight",
                                       "mlp_res_norm.weight", "mlp_res_proj.weight")]
            if self.cfg.is_kda(i):
                attn = [f"{n}.weight" for n in _KDA_NAMES] + ["A_log", "dt_bias"]
            else:
                attn = [f"{n}.weight" for n in _MLA_NAMES] + ["g_proj.weight"] * self.cfg.mla_use_output_gate
            need += [pre + "self_attn." + n for n in attn]
            mlp = [f"block_sparse_moe.{n}" for n in _MOE_NAMES] if self.cfg.is_moe(i) else ["mlp.gate_proj.weight"]
            need += [pre + n for n in mlp]
        require_tensors(self.w, need)
        H = self.cfg.kda_num_heads
        for i in (i for i in range(self.num_layers) if self.cfg.is_kda(i)):
            a = self.w[f"model.layers.{i}.self_attn.A_log"]
            if math.prod(a.shape) < A_LOG_FIRST_HEAD + H:
                raise CheckpointError(f"layer {i}: A_log has shape {tuple(a.shape)}, fewer than {H} head entries")

    def stack_decode_projections(self) -> None:
        """Stack the int8 matrices that read the same input in a one-token step into one record per group: KDA's
        q/k/v/f_a/b/g, MLA's q_a/kv_a/g, the MoE side's latent down and shared gate/up, the dense MLP's
        gate/up (``base.stack_rows``: the originals become row views of it). The bf16 kernel path then runs
        each group as one GEMV (one launch instead of two to six); other paths are unchanged. Idempotent; call
        it once other references to the weights are dropped (until then the originals stay in memory too)."""
        if self._stacked is not None:
            return
        self._stacked = {}
        w, c = self.w, self.cfg
        for i in range(self.num_layers):
            pre = f"model.layers.{i}."
            a = pre + "self_attn."
            if c.is_kda(i):
                attn = [a + f"{n}_proj.weight" for n in ("q", "k", "v", "f_a", "b", "g")]
            elif w.get(a + "q_a_proj.bias") is None and w.get(a + "kv_a_proj_with_mqa.bias") is None:
                attn = [a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight"]
                attn += [a + "g_proj.weight"] * c.mla_use_output_gate
            else:
                attn = []
            if c.is_moe(i):
                m = pre + "block_sparse_moe."
                mlp = [m + "routed_expert_down_proj.weight"]
                mlp += [m + f"shared_experts.{n}_proj.weight" for n in ("gate", "up")] * bool(c.num_shared_experts)
            else:
                mlp = [pre + f"mlp.{n}_proj.weight" for n in ("gate", "up")]
            for key, names in ((a, attn), (pre + "mlp.", mlp)):
                sizes = [w[n].shape[0] for n in names if n in w]
                t = stack_rows(w, names) if len(names) > 1 else None
                if t is not None:
                    self._stacked[key] = (t, sizes)

    def _stacked_rows(self, key: str, x: torch.Tensor) -> list[torch.Tensor] | None:
        """The outputs of the stacked group ``key`` for one token x [1, D] on the kernel path (one GEMV, split
        in the group's order), or None where it runs matrix by matrix."""
        s = self._stacked.get(key) if self._stacked and x.shape[0] == 1 and kc.enabled(x) else None
        return None if s is None else list(linear(x, s[0]).split(s[1], -1))

    def _vectors(self) -> dict[str, torch.Tensor]:
        """Small float32 tensors (norms, AttnRes vectors, conv taps, decay parameters) prepared once."""
        f32 = torch.float32
        vec = {n: dense(t, f32) for n, t in self.w.items() if len(t.shape) != 2 or t.shape[0] == 1}
        H = self.cfg.kda_num_heads
        for i in range(self.num_layers):
            pre = f"model.layers.{i}."
            for part in ("self_attention_res", "mlp_res"):
                vec[pre + part] = vec[pre + part + "_norm.weight"] * vec[pre + part + "_proj.weight"].reshape(-1)
            if self.cfg.is_kda(i):
                a = vec[pre + "self_attn.A_log"].reshape(-1)
                vec[pre + "self_attn.A_log"] = a[A_LOG_FIRST_HEAD : A_LOG_FIRST_HEAD + H]  # [H]
                for n in "qkv":
                    vec[pre + f"self_attn.{n}_conv1d.weight"] = vec[pre + f"self_attn.{n}_conv1d.weight"].flatten(1)
        out = "model.output_attn_res"
        vec[out] = vec[out + "_norm.weight"] * vec[out + "_proj.weight"].reshape(-1)
        return vec

    def new_layer_state(self, i: int, max_len: int) -> kda.KDAState | GrowingCache:
        """KDA conv + recurrent state (fp32, fixed size) or an MLA latent cache of up to max_len tokens."""
        c = self.cfg
        if c.is_kda(i):
            K = c.kda_head_dim
            return kda.KDAState.zeros(c.kda_num_heads, K, K, c.short_conv_kernel_size, self.device)
        return GrowingCache((c.kv_lora_rank + c.qk_rope_head_dim,), max_len, self.device, self.dtype)

    # ------------------------------------------------------------------ the stream

    def embed(self, ids: torch.Tensor) -> Carry:
        """The embedding is the first partial sum; layer 0 snapshots it as block 0 (§3.3)."""
        return Carry(super().embed(ids))

    def attn_part(self, i: int, carry: Carry, state: SequenceState) -> Carry:
        """AttnRes mix, snapshot, then KDA or MLA on T tokens at positions state.pos.. (§3.3 steps 1-3)."""
        pre, eps = f"model.layers.{i}.", self.cfg.rms_norm_eps
        p, blocks = carry.p, carry.blocks
        x = mix_norm(p, blocks, self.vec[pre + "self_attention_res"], self.vec[pre + "input_layernorm.weight"], eps)
        if i % self.cfg.attn_res_block_size == 0:  # snapshot the raw incoming sum, after the mix above
            blocks, p = (*blocks, p), None
        st = state.layers[i]
        a = self._kda(pre + "self_attn.", x, st) if self.cfg.is_kda(i) else \
            self._mla(pre + "self_attn.", x, st, state.pos, state.at)
        return Carry(a if p is None else p + a, blocks)

    def mlp_part(self, i: int, carry: Carry, experts: ExpertSource) -> Carry:
        """AttnRes mix, then the dense MLP (layer 0) or the latent MoE; token-wise (§3.3 steps 4-5)."""
        return Carry(carry.p + self._mlp(i, self._mlp_input(i, carry), experts), carry.blocks)

    def _mlp_input(self, i: int, carry: Carry) -> torch.Tensor:
        pre, eps = f"model.layers.{i}.", self.norm_eps
        return mix_norm(carry.p, carry.blocks, self.vec[pre + "mlp_res"], self.vec[pre + "post_attention_layernorm.weight"],
                        eps)

    def head(self, carry: Carry) -> torch.Tensor:
        """Final mix over all snapshots and p, model.norm, lm_head: float32 logits [T, V] (§3.6)."""
        x = mix_norm(carry.p, carry.blocks, self.vec["model.output_attn_res"], self.norm_w, self.norm_eps)
        return linear(x, self.lm_head).float()  # [T, V]

    # ------------------------------------------------------------------ attention

    def _kda(self, pre: str, x: torch.Tensor, st: kda.KDAState) -> torch.Tensor:
        """KDA layer (§3.1): conv'd q/k/v, lower-bound decay, delta rule in fp32, gated per-head RMSNorm."""
        T = x.shape[0]
        H, K = self.cfg.kda_num_heads, self.cfg.kda_head_dim
        w, vec = self.w, self.vec
        if T == 1 and kc.enabled(x):  # bf16 decode on the kernel path: everything between the projections fused
            o = self._kda_fused(pre, x, st)
            if o is not None:
                return linear(o, w[pre + "o_proj.weight"])
        qkv, hist = [], []
        for j, n in enumerate("qkv"):
            y = linear(x, w[pre + f"{n}_proj.weight"]).float()  # [T, H*K]
            y, h = kda.short_conv(y, vec[pre + f"{n}_conv1d.weight"], st.conv[j])
            qkv.append(y.view(T, H, K))
            hist.append(h)
        st.conv.copy_(torch.stack(hist))  # in place: a replayed CUDA graph holds these buffers
        q = kda.l2norm(qkv[0]) * K**-0.5  # fla's default scale K^-1/2 (§3.1 step 4)
        k, v = kda.l2norm(qkv[1]), qkv[2]
        z = linear(linear(x, w[pre + "f_a_proj.weight"]), w[pre + "f_b_proj.weight"]).float() + vec[pre + "dt_bias"]
        g = kda.lower_bound_gate(z.view(T, H, K), vec[pre + "A_log"], self.cfg.gate_lower_bound)  # [T, H, K]
        beta = torch.sigmoid(linear(x, w[pre + "b_proj.weight"]).float())  # [T, H]
        if T == 1:
            o, S = kda.recurrent(q, k, v, g, beta, st.S)
        else:
            products = kc.kda_products if kc.enabled(x) else None  # fused in-chunk products on the fast CUDA path
            o, S = kda.chunked(q, k, v, g, beta, st.S, self.kda_chunk, self.cfg.gate_lower_bound,
                               products=products)
        st.S.copy_(S)
        gate = torch.sigmoid(linear(x, w[pre + "g_proj.weight"]).float()).view(T, H, K)
        o = rms_norm(o, vec[pre + "o_norm.weight"], self.cfg.rms_norm_eps) * gate  # [T, H, K]
        return linear(o.reshape(T, H * K).to(x.dtype), w[pre + "o_proj.weight"])

    def _kda_fused(self, pre: str, x: torch.Tensor, st: kda.KDAState) -> torch.Tensor | None:
        """The one-token KDA step in one kernel after the projections (kernels/triton_small.py), or None."""
        c, w, vec = self.cfg, self.w, self.vec
        ys = self._stacked_rows(pre, x)
        if ys is not None:
            *proj, fa, b, gl = ys
        else:
            proj = [linear(x, w[pre + f"{n}_proj.weight"]) for n in "qkv"]
            fa = linear(x, w[pre + "f_a_proj.weight"])
            b, gl = linear(x, w[pre + "b_proj.weight"]), linear(x, w[pre + "g_proj.weight"])
        taps = [vec[pre + f"{n}_conv1d.weight"] for n in "qkv"]
        z = linear(fa, w[pre + "f_b_proj.weight"])
        return kc.kda_step(x, c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size, st.conv, st.S, *proj, *taps,
                           z, vec[pre + "dt_bias"], vec[pre + "A_log"], b, gl, vec[pre + "o_norm.weight"],
                           c.gate_lower_bound, c.rms_norm_eps, c.kda_head_dim**-0.5, kda.L2_EPS)

    def _mla(self, pre: str, x: torch.Tensor, cache: GrowingCache, pos: int, at: torch.Tensor | None = None
             ) -> torch.Tensor:
        """Gated MLA without rope (§3.2): latent cache; absorbed form for one token, expanded for more.
        ``at`` (one token only): the position as a device tensor; the token attends over the cache's whole
        buffer with the rows past it masked, so nothing here depends on the Python int (a CUDA graph)."""
        c, T, w = self.cfg, x.shape[0], self.w
        if pos + T > cache.max_len:
            raise ValueError(f"MLA cache holds {cache.max_len} tokens; cannot add {T} at position {pos}; "
                             f"create the state with a larger max_len")
        H, dn, r, R = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        ys = self._stacked_rows(pre, x)  # (q_a, kv_a[, g]) in one GEMV on the one-token kernel path
        qa, kv, gl = (ys + [None])[:3] if ys is not None else (None, None, None)
        q, latent, k_pe = mla.project(x, lambda n: w.get(pre + n), H, dn, r, R, qa=qa, kv=kv)  # k_pe un-rotated
        scale = (dn + r) ** -0.5  # §3.2 step 4: 192^-0.5 for K3
        if at is None and T == 1 and x.is_cuda:  # an eager step attends as a replayed one (see GrowingCache.whole)
            cache.whole()
            at = torch.full((1,), pos, dtype=torch.long, device=x.device)
            cache.length = pos + 1
        if at is not None and T == 1:
            rows = cache.write_at(at, torch.cat((latent, k_pe), -1))  # [capacity, R+r]
            ctx = mla.attend_absorbed(q[..., :dn], q[..., dn:], rows, w[pre + "kv_b_proj.weight"], dn,
                                      c.v_head_dim, scale, at)
        else:
            rows = cache.write(pos, torch.cat((latent, k_pe), -1))  # [S, R+r]
            attend = mla.attend_absorbed if T == 1 else mla.attend_expanded
            ctx = attend(q[..., :dn], q[..., dn:], rows, w[pre + "kv_b_proj.weight"], dn, c.v_head_dim, scale, pos)
        if c.mla_use_output_gate:
            gl = linear(x, w[pre + "g_proj.weight"]) if gl is None else gl
            ctx = ctx * torch.sigmoid(gl.float()).to(ctx.dtype)
        return linear(ctx, w[pre + "o_proj.weight"])

    # ------------------------------------------------------------------ MLPs

    def _situ_mlp(self, pre: str, x: torch.Tensor, gu: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """SiTU-GLU MLP: the dense layer-0 MLP and the fused shared experts (``gu``: gate x and up x if known)."""
        c, w = self.cfg, self.w
        gate, up, down = (w[pre + f"{n}_proj.weight"] for n in ("gate", "up", "down"))
        if gu is None:
            y = fused_glu(x, gate, up, down, self.glu)  # one call where they are 4-bit on the fast CPU path
            if y is not None:
                return y
            gu = (linear(x, gate), linear(x, up))
        a = situ_glu(gu[0], gu[1], c.activation_situ_beta, c.activation_situ_linear_beta)
        return linear(a, down)

    def _dense_mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        pre = f"model.layers.{i}.mlp."
        return self._situ_mlp(pre, x, self._stacked_rows(pre, x))

    def _is_moe(self, i: int) -> bool:
        return self.cfg.is_moe(i)

    def _router(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """§3.4 step 1: sigmoid scores in fp32; the correction bias only picks the experts; the weights are the
        unbiased scores of the chosen ones, renormalised, times routed_scaling_factor."""
        c, pre = self.cfg, f"model.layers.{i}.block_sparse_moe.gate."
        bias = self.vec[pre + "e_score_correction_bias"]
        got = kc.router_topk(x, self.w[pre + "weight"], bias, c.num_experts_per_token, c.moe_renormalize,
                             c.routed_scaling_factor, ROUTER_RENORM_EPS)  # one launch for a decode step
        if got is not None:
            return got
        logits = linear(x.float(), self.w[pre + "weight"])  # [T, E]
        return sigmoid_topk(logits, bias, c.num_experts_per_token, c.moe_renormalize, c.routed_scaling_factor)

    def _moe(self, i: int, x: torch.Tensor, experts: ExpertSource) -> torch.Tensor:
        """Stable LatentMoE (§3.4): route on x, experts in the latent, norm the aggregate, up, + shared(x)."""
        ids, wts = self._router(i, x)
        ids_host, (z, shared) = ids_to_host_during(ids, lambda: self._moe_side(i, x))
        y = moe_dispatch(z, ids, wts, i, experts, self._expert, self.glu, ids_host)  # [T, Lat] sum over slots
        return self._moe_finish(i, y, shared)

    @property
    def glu(self) -> tuple:
        """The routed experts' activation, as the grouped CUDA kernels name it."""
        return ("situ", self.cfg.activation_situ_beta, self.cfg.activation_situ_linear_beta)

    # A runner that syncs with the host once per MoE layer splits mlp_part into: moe_begin (input mix and
    # norm, router: all the host needs to fetch the experts), moe_side (the latent down projection and the
    # shared experts, which the GPU can run while the host fetches), then moe_end once the routed experts ran:
    # moe_end(i, c, r, side, moe_dispatch(side[0], r.ids, r.weights, ...)) equals mlp_part(i, c, ...) bit for bit.

    def moe_begin(self, i: int, carry: Carry) -> Routed:
        x = self._mlp_input(i, carry)
        return Routed(*self._router(i, x), x)

    def moe_side(self, i: int, r: Routed) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(z [T, Lat] the routed experts' input, the shared experts' output [T, D] or None)."""
        return self._moe_side(i, r.x)

    def moe_end(self, i: int, carry: Carry, r: Routed, side: tuple, y: torch.Tensor) -> Carry:
        """The rest of ``mlp_part`` given y [T, Lat], the routing-weighted sum of the routed experts on z."""
        return Carry(carry.p + self._moe_finish(i, y, side[1]), carry.blocks)

    def _moe_side(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        pre = f"model.layers.{i}.block_sparse_moe."
        ys = self._stacked_rows(f"model.layers.{i}.mlp.", x)  # (latent down, shared gate, up) in one GEMV
        if ys is not None:
            return ys[0], self._situ_mlp(pre + "shared_experts.", x, ys[1:]) if len(ys) == 3 else None
        z = linear(x, self.w[pre + "routed_expert_down_proj.weight"])  # [T, Lat]
        return z, self._situ_mlp(pre + "shared_experts.", x) if self.cfg.num_shared_experts else None

    def _moe_finish(self, i: int, y: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        pre = f"model.layers.{i}.block_sparse_moe."
        if self.cfg.latent_moe_use_norm:
            y = rms_norm(y, self.vec[pre + "routed_expert_norm.weight"], self.cfg.rms_norm_eps)
        y = linear(y, self.w[pre + "routed_expert_up_proj.weight"])  # [T, D]
        return y if shared is None else y + shared

    def _expert(self, z: torch.Tensor, t: ExpertTensors) -> torch.Tensor:
        """One routed expert on its tokens' latents z [n, Lat], in float32 (MXFP4 records dequantized)."""
        c, zf = self.cfg, z.float()
        y = fused_glu(zf, t["gate"], t["up"], t["down"], self.glu)  # None off the fast CPU path
        if y is None:
            a = situ_glu(linear(zf, t["gate"]), linear(zf, t["up"]), c.activation_situ_beta,
                         c.activation_situ_linear_beta)
            y = linear(a, t["down"])
        return y.to(z.dtype)
