"""Next-token choice: greedy, or temperature / top-k / top-p / min-p sampling with a seeded generator.

Before the choice, optional processors change the logits in this order: logit bias, repetition penalty
(prompt and output tokens, divided when positive and multiplied when negative), presence and frequency
penalties (output tokens, subtracted as OpenAI defines them), then a grammar's token mask. With none of
them set, the choice is made from the model's logits untouched (greedy stays ``argmax``).
"""

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
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 means none
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise UsageError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p must be in (0, 1] (1 keeps every token), got {self.top_p}")
        if self.top_k < 0:
            raise UsageError(f"top_k must be >= 0 (0 means no limit), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise UsageError(f"min_p must be in [0, 1] (0 keeps every token), got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise UsageError(f"repetition_penalty must be > 0 (1 means none), got {self.repetition_penalty}")
        if self.seed is not None and not -(2**63) <= self.seed <= SEED_MAX:
            raise UsageError(f"seed must fit in 64 bits (-2^63 to 2^64 - 1), got {self.seed}")

    @property
    def processed(self) -> bool:
        """Whether any processor changes the logits before the choice."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """The choice of one sequence's tokens. ``prompt``: its prompt ids (for the repetition penalty);
    ``constraint``: an object with ``mask(logits)`` (disallowed tokens to -inf, in place) and ``accept(tok)``,
    such as a compiled grammar's matcher."""

    def __init__(self, params: SamplingParams, prompt: tuple[int, ...] | list[int] = (), constraint=None):
        self.params, self.constraint = params, constraint
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()
        self.counts: dict[int, int] = {}  # output tokens so far
        self.seen = set(prompt) if params.repetition_penalty != 1 else set()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] float32 -> token id."""
        p = self.params
        if p.processed or self.constraint is not None:
            logits = self.process(logits)
        if p.greedy:
            tok = int(torch.argmax(logits))
        else:
            tok = int(torch.multinomial(filtered_probs(logits.float().cpu(), p), 1, generator=self.gen))
        self.counts[tok] = self.counts.get(tok, 0) + 1
        if p.repetition_penalty != 1:
            self.seen.add(tok)
        if self.constraint is not None:
            self.constraint.accept(tok)
        return tok

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """A processed copy of ``logits`` [V] (float32, on the CPU)."""
        p, z = self.params, logits.float().cpu().clone()
        V = z.numel()
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if t < V], dtype=torch.long)
            z[ids] += torch.tensor([b for t, b in p.logit_bias if t < V])
        if p.repetition_penalty != 1 and self.seen:
            ids = torch.tensor(sorted(t for t in self.seen if t < V), dtype=torch.long)
            v = z[ids]
            z[ids] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.counts:
            ids = torch.tensor([t for t in self.counts if t < V], dtype=torch.long)
            n = torch.tensor([float(self.counts[t]) for t in self.counts if t < V])
            z[ids] -= n * p.frequency_penalty + p.presence_penalty
        if self.constraint is not None:
            self.constraint.mask(z)
        return z


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    z = logits / max(p.temperature, 1e-6)
    if p.top_k and p.top_k < z.numel():
        kth = torch.topk(z, p.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    if p.top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < p.top_p  # keep the smallest set reaching top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[idx[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs
