"""Rotary position embeddings for every family: settings from a config dict, frequencies, tables, rotation.

- ``rope_parameters(d, default_theta, defaults)``: the HF rope settings of a config dict as one flat dict
  (transformers 5 ``rope_parameters``, or 4.x ``rope_scaling`` + top-level ``rope_theta``).
- ``RopeConfig``: those settings resolved for one rotary width; ``inv_freq()`` and ``cos_sin_factor``
  follow transformers' ``modeling_rope_utils`` (default, linear, yarn, llama3).
- ``Rope(params, head_dim, max_position_embeddings, device)``: ``.cos_sin(pos, T)`` tables on a device.
- ``apply_rope(x, cos, sin, interleaved)``: rotate the first rotary channels, in halves or interleaved pairs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from deltafin.errors import CheckpointError, UnsupportedArchitectureError
from deltafin.kernels import rope_one

KINDS = ("default", "linear", "yarn", "llama3")


def rope_parameters(d: Mapping, default_theta: float = 10000.0, defaults: Mapping | None = None) -> dict:
    """Flat rope settings of an HF config dict, as transformers 5 standardises them.

    Reads ``rope_scaling`` (4.x; it wins, as in transformers) or ``rope_parameters``, else the family's
    ``defaults``; the legacy key ``type`` becomes ``rope_type``. Always has ``rope_type`` and ``rope_theta``.
    """
    p = dict(d.get("rope_scaling") or d.get("rope_parameters") or defaults or {})
    legacy_type = p.pop("type", "default")
    p.setdefault("rope_type", legacy_type)
    p.setdefault("rope_theta", d.get("rope_theta", default_theta))
    if d.get("partial_rotary_factor") is not None:
        p.setdefault("partial_rotary_factor", d["partial_rotary_factor"])
    if p["rope_type"] in ("yarn", "llama3"):  # a top-level value wins, as in transformers (Phi-3)
        if d.get("original_max_position_embeddings") is not None:
            p["original_max_position_embeddings"] = d["original_max_position_embeddings"]
        p.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    return p


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True, slots=True)
class RopeConfig:
    dim: int  # rotary width per head (partial rotary: less than the head width)
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
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UnsupportedArchitectureError(
                f"rope type {self.kind!r} is not supported; supported: {', '.join(KINDS)}"
            )
        if self.kind == "llama3" and (self.low_freq_factor is None or self.high_freq_factor is None):
            raise CheckpointError(
                "llama3 rope settings lack low_freq_factor/high_freq_factor; fix config.json"
            )
        assert self.dim % 2 == 0, self.dim

    @classmethod
    def from_params(cls, p: Mapping, head_dim: int, max_position_embeddings: int) -> RopeConfig:
        """From the flat settings of :func:`rope_parameters` for heads of ``head_dim`` channels."""
        kind = p.get("rope_type", "default")
        orig = p.get("original_max_position_embeddings") or max_position_embeddings
        factor = p.get("factor")
        if factor is None:  # YaRN without a factor: the ratio of the extended to the pretrained length
            factor = max_position_embeddings / orig if kind == "yarn" else 1.0
        lo, hi = p.get("low_freq_factor"), p.get("high_freq_factor")
        return cls(
            dim=int(head_dim * p.get("partial_rotary_factor", 1.0)),
            theta=float(p["rope_theta"]),
            kind=kind,
            factor=float(factor),
            original_max=int(orig),
            beta_fast=float(p.get("beta_fast") or 32),
            beta_slow=float(p.get("beta_slow") or 1),
            mscale=p.get("mscale"),
            mscale_all_dim=p.get("mscale_all_dim"),
            attention_factor=p.get("attention_factor"),
            truncate=bool(p.get("truncate", True)),
            low_freq_factor=None if lo is None else float(lo),
            high_freq_factor=None if hi is None else float(hi),
        )

    @classmethod
    def from_config(
        cls, d: Mapping, head_dim: int, default_theta: float = 10000.0, defaults: Mapping | None = None
    ) -> RopeConfig:
        """From a config.json dict whose dataclass keeps no ``max_position_embeddings`` of its own."""
        p = rope_parameters(d, default_theta, defaults)
        return cls.from_params(p, head_dim, d.get("max_position_embeddings", 4096))

    def inv_freq(self) -> torch.Tensor:
        """[dim/2] float32 inverse frequencies."""
        pos_freqs = self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim)
        if self.kind == "yarn":
            return self._yarn(pos_freqs)
        inv = 1.0 / pos_freqs
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "llama3":
            return self._llama3(inv)
        return inv

    def _yarn(self, pos_freqs: torch.Tensor) -> torch.Tensor:
        # YaRN (arXiv 2309.00071): interpolate low frequencies, keep high ones, linear ramp between
        low, high = self._correction_range()
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(self.dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation

    def _correction_range(self) -> tuple[float, float]:
        def dim_for(rotations: float) -> float:  # dimension index making `rotations` turns over original_max
            return (
                self.dim
                * math.log(self.original_max / (rotations * 2 * math.pi))
                / (2 * math.log(self.theta))
            )

        low, high = dim_for(self.beta_fast), dim_for(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, self.dim - 1)

    def _llama3(self, inv: torch.Tensor) -> torch.Tensor:
        factor, lo, hi, old = self.factor, self.low_freq_factor, self.high_freq_factor, self.original_max
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)

    @property
    def cos_sin_factor(self) -> float:
        """What YaRN multiplies cos and sin by (1 for the other kinds)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


def rope_frequencies(p: Mapping, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim/2] float32, cos/sin factor) for the flat rope settings ``p``."""
    cfg = RopeConfig.from_params(p, head_dim, max_position_embeddings)
    return cfg.inv_freq(), cfg.cos_sin_factor


class Rope:
    """Rotary tables of one setting on one device, computed per call in float32 as transformers does.

    ``params``: the flat settings of :func:`rope_parameters` (with ``head_dim`` and
    ``max_position_embeddings``), or an already resolved :class:`RopeConfig`.
    """

    def __init__(
        self,
        params: Mapping | RopeConfig,
        head_dim: int | None = None,
        max_position_embeddings: int | None = None,
        device: torch.device | str = "cpu",
    ):
        if not isinstance(params, RopeConfig):
            assert head_dim is not None and max_position_embeddings is not None
            params = RopeConfig.from_params(params, head_dim, max_position_embeddings)
        self.config = params
        self.dim = params.dim  # rotary width r
        self.factor = params.cos_sin_factor
        self.inv_freq = params.inv_freq().to(device)  # [r/2]
        self._last: tuple | None = None  # (pos, T, cos, sin): every layer of a step asks for the same positions

    def cos_sin(self, pos: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, r/2] float32 for positions pos .. pos+T-1 (the CPU's last answer kept for the next layer;
        a CUDA graph records its own)."""
        last = self._last
        if last is not None and last[0] == pos and last[1] == T:
            return last[2], last[3]
        t = torch.arange(pos, pos + T, device=self.inv_freq.device, dtype=torch.int64).float()
        freqs = t[:, None] * self.inv_freq[None]  # [T, r/2]
        cos, sin = freqs.cos() * self.factor, freqs.sin() * self.factor
        if self.inv_freq.device.type == "cpu" and T <= 64:
            self._last = (pos, T, cos, sin)
        return cos, sin


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate the first r channels of x [T, ..., d] by cos/sin [T, r/2]; channels past r pass through.

    ``interleaved=False``: pairs are (i, i + r/2) (GPT-NeoX halves). ``interleaved=True``: pairs are
    (2i, 2i+1) (DeepSeek ``rope_interleave``); the result is written de-interleaved (rotated evens, then
    rotated odds), as transformers does, which leaves every q.k dot product unchanged as q and k agree.
    """
    if not interleaved and x.dim() == 3 and x.shape[0] == 1 and x.device.type == "cpu":  # one token, the CPU's
        y = rope_one(x, cos, sin)  # fast path: one compiled call
        if y is not None:
            return y
    r = 2 * cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype)
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else rot.chunk(2, dim=-1)
    out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)
