"""Next-token choice: greedy, or temperature / top-k / top-p sampling with a seeded generator."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deltafin.errors import UsageError

SEED_MAX = 2**64 - 1  # torch generators take 64-bit seeds


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no limit
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise UsageError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p must be in (0, 1] (1 keeps every token), got {self.top_p}")
        if self.top_k < 0:
            raise UsageError(f"top_k must be >= 0 (0 means no limit), got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed <= SEED_MAX:
            raise UsageError(f"seed must fit in 64 bits (-2^63 to 2^64 - 1), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] float32 -> token id."""
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        probs = filtered_probs(logits.float().cpu(), p)
        return int(torch.multinomial(probs, 1, generator=self.gen))


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    z = logits / max(p.temperature, 1e-6)
    if p.top_k and p.top_k < z.numel():
        kth = torch.topk(z, p.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if p.top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < p.top_p  # keep the smallest set reaching top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[idx[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs
