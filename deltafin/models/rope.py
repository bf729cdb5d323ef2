"""Rotary position embeddings: plain, linear and YaRN frequencies, and the two pair layouts.

Frequencies follow transformers' ``modeling_rope_utils`` (default, linear, yarn). ``Rope.cos_sin``
returns tables of half the rotary width, already multiplied by the YaRN attention factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deltafin.errors import UnsupportedArchitectureError

KINDS = ("default", "linear", "yarn")


@dataclass(frozen=True, slots=True)
class Rope:
    dim: int  # rotary width per head
    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # explicit YaRN cos/sin factor (else derived from mscales)
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UnsupportedArchitectureError(
                f"rope type {self.kind!r} is not supported; supported: {', '.join(KINDS)}"
            )
        assert self.dim % 2 == 0, self.dim

    @classmethod
    def from_config(
        cls, d: dict, dim: int, default_theta: float = 10000.0, defaults: dict | None = None
    ) -> Rope:
        """From a config dict: transformers-5 ``rope_parameters`` or older ``rope_scaling`` + ``rope_theta``."""
        # transformers: rope_scaling wins over rope_parameters; family defaults only when neither is given
        p = dict(d.get("rope_scaling") or d.get("rope_parameters") or defaults or {})
        kind = p.get("rope_type", p.get("type", "default"))
        theta = p.get("rope_theta", d.get("rope_theta", default_theta))
        orig = d.get("original_max_position_embeddings") or p.get("original_max_position_embeddings")
        max_pos = d.get("max_position_embeddings", 4096)
        factor = p.get("factor")
        if factor is None:  # DeepSeek: the ratio of the extended to the pretrained length
            factor = max_pos / orig if (orig and kind == "yarn") else 1.0
        return cls(
            dim=dim,
            theta=float(theta),
            kind=kind,
            factor=float(factor),
            original_max=int(orig or max_pos),
            beta_fast=float(p.get("beta_fast") or 32),
            beta_slow=float(p.get("beta_slow") or 1),
            mscale=p.get("mscale"),
            mscale_all_dim=p.get("mscale_all_dim"),
            attention_factor=p.get("attention_factor"),
            truncate=bool(p.get("truncate", True)),
        )

    def inv_freq(self) -> torch.Tensor:
        """[dim/2] float32 inverse frequencies."""
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim
        if self.kind == "default":
            return 1.0 / (self.theta**exponents)
        if self.kind == "linear":
            return 1.0 / (self.theta**exponents) / self.factor
        return self._yarn_inv_freq(self.theta**exponents)

    def _yarn_inv_freq(self, pos_freqs: torch.Tensor) -> torch.Tensor:
        # YaRN (arXiv 2309.00071): interpolate low frequencies, keep high ones, linear ramp between
        low, high = self._correction_range()
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(self.dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation

    def _correction_range(self) -> tuple[float, float]:
        def dim_for(rotations: float) -> float:
            return (
                self.dim
                * math.log(self.original_max / (rotations * 2 * math.pi))
                / (2 * math.log(self.theta))
            )

        low, high = dim_for(self.beta_fast), dim_for(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, self.dim - 1)

    @property
    def cos_sin_factor(self) -> float:
        """What YaRN multiplies cos and sin by (1 for plain RoPE)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def cos_sin(self, inv_freq: torch.Tensor, pos: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, dim/2] for positions pos .. pos+T-1 (float32, on inv_freq's device)."""
        p = torch.arange(pos, pos + T, device=inv_freq.device, dtype=torch.float32)
        freqs = p[:, None] * inv_freq[None, :]  # [T, dim/2]
        f = self.cos_sin_factor
        return freqs.cos() * f, freqs.sin() * f


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate x [T, ..., d] by cos/sin [T, d/2].

    ``interleaved=False``: pairs are (i, i + d/2) (GPT-NeoX halves). ``interleaved=True``: pairs are
    (2i, 2i+1) (DeepSeek); the result is written de-interleaved (rotated evens, then rotated odds), as
    transformers does, which leaves every q.k dot product unchanged as long as q and k agree.
    """
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
