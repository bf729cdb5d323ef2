"""DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``): DeepSeek-V3's MLA and router with DSA, the
lightning indexer that picks, per query, the ``index_topk`` earlier tokens the attention may read.

The indexer has its own key per token (``wk`` then a LayerNorm, RoPE on its first r channels: rotated halves
in DeepSeek-V3.2, interleaved pairs in GLM-5) kept beside the latent cache, and per query ``index_n_heads``
heads from the query's low-rank residual (``wq_b``). A token's score is sum_h w_h relu(q_h . k / sqrt(Di))
with w = weights_proj(x) / sqrt(heads); the top k by score (causal) are attended. GLM-5's ``shared`` layers
reuse the previous full layer's choice. A decode step gathers only the chosen rows of the latent cache.

Legend: T query tokens, S cached tokens (including these T), Hi indexer heads, Di their width, k index_topk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltafin.errors import UnsupportedArchitectureError
from deltafin.models import deepseek_v3, mla
from deltafin.models.base import SequenceState, dense, linear, rms_norm
from deltafin.models.layers import KVCache
from deltafin.models.rope import apply_rope

MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
READS = (
    *deepseek_v3.READS,
    r"model\.layers\.\d+\.self_attn\.indexer\.(wq_b|wk|weights_proj)\.weight",
    r"model\.layers\.\d+\.self_attn\.indexer\.k_norm\.(weight|bias)",
)
# transformers' GlmMoeDsaConfig defaults where they differ from DeepSeek-V3's
GLM5_DEFAULTS = dict(n_group=1, topk_group=1, rms_norm_eps=1e-5)
INDEXER_NORM_EPS = 1e-6  # the indexer's k_norm: nn.LayerNorm(eps=1e-6) in the reference


@dataclass(frozen=True)
class Config(deepseek_v3.Config):
    index_topk: int = 2048
    index_n_heads: int = 64
    index_head_dim: int = 128
    indexer_types: tuple[str, ...] | None = None  # GLM-5: "full" | "shared" per layer
    model_type: str = "deepseek_v32"

    SERVES = MODEL_TYPES

    def __post_init__(self) -> None:
        deepseek_v3.Config.__post_init__(self)
        if self.q_lora_rank is None:
            raise UnsupportedArchitectureError(f"{self.model_type}: the DSA indexer reads the query's low-rank "
                                               f"residual; q_lora_rank must be set")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise UnsupportedArchitectureError(f"{self.model_type}: index_head_dim {self.index_head_dim} is narrower "
                                               f"than the rotary width {self.qk_rope_head_dim}")
        kinds = self.indexer_types or ("full",) * self.num_hidden_layers
        if len(kinds) != self.num_hidden_layers or set(kinds) - {"full", "shared"} or kinds[0] != "full":
            raise UnsupportedArchitectureError(f"{self.model_type}: indexer_types must list 'full' or 'shared' for "
                                               f"each of {self.num_hidden_layers} layers, the first 'full'")
        object.__setattr__(self, "indexer_types", tuple(kinds))

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        """From a config.json dict; unknown keys are ignored."""
        if d.get("model_type") == "glm_moe_dsa":
            d = {**GLM5_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
        if d.get("indexer_types") is not None:
            d = {**d, "indexer_types": tuple(d["indexer_types"])}
        return super().from_dict(d)

    @property
    def indexer_interleaved(self) -> bool:
        return self.model_type == "glm_moe_dsa"


class DSACache(KVCache):
    """One DSA layer's cache: the MLA latent rows [1, S, R+r] as "keys" and the indexer's keys [1, S, Di] as
    "values", so the prompt cache and batching treat it as any per-position cache. ``topk`` holds the last call's
    choice [T, k] for the shared layers after it."""

    topk: torch.Tensor | None = None


class Model(deepseek_v3.Model):
    """DeepSeek-V3 with the DSA indexer in front of every layer's attention."""

    def new_layer_state(self, i: int, max_len: int) -> DSACache:
        c = self.cfg
        return DSACache(1, c.kv_lora_rank + c.qk_rope_head_dim, c.index_head_dim, max_len, self.device, self.dtype)

    def _attention(self, i: int, h: torch.Tensor, state: SequenceState) -> torch.Tensor:
        c, (T, _), pos = self.cfg, h.shape, state.pos
        H, dn, r, R = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        pre = f"model.layers.{i}.self_attn."
        p = self.w.get
        qa = linear(h, p(pre + "q_a_proj.weight"), p(pre + "q_a_proj.bias"))
        q, latent, k_pe = mla.project(h, lambda n: p(pre + n), H, dn, r, R, True, qa=qa)
        cos, sin = self.rope.cos_sin(pos, T)  # [T, r/2]
        q_rot = apply_rope(q[..., dn:], cos, sin, c.rope_interleave)  # [T, H, r]
        k_rot = apply_rope(k_pe, cos, sin, c.rope_interleave)  # [T, r]
        cache: DSACache = state.layers[i]
        ikey = self._index_key(pre, h, cos, sin) if c.indexer_types[i] == "full" else None
        rows, ikeys = cache.update(torch.cat((latent, k_rot), -1)[:, None], ikey[:, None] if ikey is not None else
                                   h.new_zeros(T, 1, c.index_head_dim), pos)
        rows, ikeys = rows[0], ikeys[0]  # [S, R+r], [S, Di]
        if ikey is None:  # a shared layer: the choice of the last full layer before it
            cache.topk = next(state.layers[j].topk for j in range(i - 1, -1, -1) if c.indexer_types[j] == "full")
        else:
            q_resid = rms_norm(qa, p(pre + "q_a_layernorm.weight"), mla.LATENT_NORM_EPS)  # [T, q_lora_rank]
            cache.topk = self._select(pre, h, q_resid, ikeys, cos, sin, pos)  # [T, k]
        w_kv_b = p(pre + "kv_b_proj.weight")
        o = _attend_selected(q[..., :dn], q_rot, rows, w_kv_b, dn, c.v_head_dim, c.softmax_scale, pos, cache.topk)
        return linear(o, p(pre + "o_proj.weight"), p(pre + "o_proj.bias"))

    def _index_key(self, pre: str, h: torch.Tensor, cos, sin) -> torch.Tensor:
        """The indexer's key of each token [T, Di]: LayerNorm(wk h), its first r channels rotated."""
        c, p = self.cfg, self.w.get
        k = linear(h, p(pre + "indexer.wk.weight")).float()
        ln_w, ln_b = (dense(p(pre + f"indexer.k_norm.{n}"), torch.float32) for n in ("weight", "bias"))
        k = F.layer_norm(k, (k.shape[-1],), ln_w, ln_b, INDEXER_NORM_EPS).to(h.dtype)
        r = c.qk_rope_head_dim
        return torch.cat((apply_rope(k[:, None, :r], cos, sin, c.indexer_interleaved)[:, 0], k[:, r:]), -1)

    def _select(self, pre: str, h, q_resid, ikeys, cos, sin, pos: int) -> torch.Tensor:
        """The top index_topk earlier tokens of each query [T, min(k, S)] by the indexer's score (causal: a later
        token scores -inf), ties broken by torch.topk as the reference's."""
        c, p, T = self.cfg, self.w.get, h.shape[0]
        Hi, Di, r = c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim
        q = linear(q_resid, p(pre + "indexer.wq_b.weight")).view(T, Hi, Di)
        q = torch.cat((apply_rope(q[..., :r], cos, sin, c.indexer_interleaved), q[..., r:]), -1)  # [T, Hi, Di]
        scores = F.relu(torch.matmul(q.float(), ikeys.float().T) * Di**-0.5)  # [T, Hi, S]
        w = linear(h, p(pre + "indexer.weights_proj.weight")).float() * Hi**-0.5  # [T, Hi]
        index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)  # [T, S]
        S = index.shape[-1]
        later = torch.arange(S, device=h.device)[None] > torch.arange(pos, pos + T, device=h.device)[:, None]
        index = index.masked_fill(later, float("-inf"))
        return index.topk(min(c.index_topk, S), dim=-1).indices  # [T, k]


def _attend_selected(q_nope, q_rot, rows, w_kv_b, dn: int, dv: int, scale: float, pos: int,
                     topk: torch.Tensor) -> torch.Tensor:
    """MLA over the chosen rows only: q_nope [T, H, dn], q_rot [T, H, r], rows [S, R+r], topk [T, k] -> [T, H*dv].
    One token reads just its k rows (absorbed); a prefill chunk attends the causal chosen ones (expanded)."""
    T, H, _ = q_nope.shape
    S = rows.shape[0]
    if T == 1:
        chosen = rows[topk[0]]  # [k, R+r]: every chosen row is at or before the query
        return mla.attend_absorbed(q_nope, q_rot, chosen, w_kv_b, dn, dv, scale, chosen.shape[0] - 1)
    allowed = torch.zeros(T, S, dtype=torch.bool, device=rows.device).scatter_(1, topk, True)
    allowed &= torch.arange(S, device=rows.device)[None] <= torch.arange(pos, pos + T, device=rows.device)[:, None]
    r = q_rot.shape[-1]
    R = rows.shape[-1] - r
    kv = linear(rows[:, :R], w_kv_b).view(S, H, dn + dv)  # [S, H, dn+dv]
    k = torch.cat((kv[..., :dn], rows[:, None, R:].expand(S, H, r)), dim=-1)  # [S, H, dn+r]
    q = torch.cat((q_nope, q_rot), dim=-1)  # [T, H, dn+r]
    logits = torch.einsum("thd,shd->hts", q, k) * scale  # [H, T, S]
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("hts,shd->thd", probs, kv[..., dn:]).reshape(T, H * dv)
