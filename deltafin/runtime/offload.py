"""A trunk split between two devices (``offload_plan``): the first layers on the CPU, the last and the head on the GPU.

Each device holds a model of the family over its own layers' records: the other device's layers are stand-ins
on torch's meta device (shape and format, no memory), so the family code builds unchanged and no record exists
twice. ``SplitModel`` runs each layer on the model that holds it, each layer's state (KV cache, latent cache,
recurrent state) lives on that layer's device, and the carry (the residual stream, or a family's richer carry
such as Kimi K3's AttnRes snapshots) is handed over once, at the first GPU layer, in the GPU side's dtype.
``SplitExperts`` serves each layer's routed experts where the layer computes: the CPU layers' from host buffers
and a host cache, the GPU layers' through the GPU slab, over the same drive readers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from deltafin.models.base import SequenceState, forward_parts
from deltafin.quant.record import QTensor
from deltafin.runtime.offload_plan import EMBED, OffloadPlan, layer_of
from deltafin.runtime.source import SourceStats

META = torch.device("meta")


def stand_in(t: QTensor | torch.Tensor) -> QTensor | torch.Tensor:
    """The record's shape and format on the meta device: what a model built for the other device holds for it."""
    if isinstance(t, torch.Tensor):
        return torch.empty_like(t, device=META)
    return QTensor(t.format, t.shape, torch.empty_like(t.data, device=META),
                   None if t.scale is None else torch.empty_like(t.scale, device=META))


def split_weights(weights: Mapping[str, QTensor], plan: OffloadPlan, gpu: torch.device
                  ) -> tuple[dict[str, QTensor], dict[str, QTensor]]:
    """(CPU side, GPU side) records: a layer's records real on its device and stand-ins on the other; the
    embeddings real on the CPU (the GPU's too when the head reads them: tied), lm_head on the GPU, the other
    top-level records (norms, small head vectors) real on both."""
    tied = "lm_head.weight" not in weights
    low, high = {}, {}
    for name, t in weights.items():
        i = layer_of(name)
        if i is not None:
            mine = plan.on_gpu(i)
        elif name == EMBED:
            low[name], high[name] = t, (t.to(gpu) if tied else stand_in(t))
            continue
        elif name == "lm_head.weight":
            mine = True
        else:
            low[name], high[name] = t, t.to(gpu)
            continue
        if mine:
            low[name], high[name] = stand_in(t), t.to(gpu)
        else:
            low[name], high[name] = t, stand_in(t)
    return low, high


def build_split(family: str, text_config: dict, weights: Mapping[str, QTensor], plan: OffloadPlan,
                high: torch.device, low_dtype: torch.dtype, high_dtype: torch.dtype, prepare_low=None) -> SplitModel:
    """The SplitModel of a plan: a model over the CPU side's records and one over ``high``'s (the GPU; tests run
    both sides on the CPU). ``prepare_low(records)``: the CPU side's records as its path wants them."""
    from deltafin.models import registry

    low_w, high_w = split_weights(weights, plan, high)
    if prepare_low is not None:
        low_w = prepare_low(low_w)
    lo = registry.build(family, text_config, low_w, torch.device("cpu"), low_dtype)
    del low_w
    return SplitModel(lo, registry.build(family, text_config, high_w, high, high_dtype), plan.first_gpu)


def hand_over(carry, device: torch.device, dtype: torch.dtype):
    """The carry on ``device``, its floating tensors in ``dtype``: a tensor, a tuple of them, or a family's carry
    dataclass (each field moved)."""
    if isinstance(carry, torch.Tensor):
        return carry.to(device, dtype) if carry.is_floating_point() else carry.to(device)
    if isinstance(carry, tuple):
        return tuple(hand_over(c, device, dtype) for c in carry)
    if dataclasses.is_dataclass(carry):
        return type(carry)(**{f.name: hand_over(getattr(carry, f.name), device, dtype)
                              for f in dataclasses.fields(carry)})
    return carry


class SplitModel:
    """The Model API (``deltafin.models.base``) over two models of one family: layers [0, first) and the
    embeddings in ``low``, layers [first, L) and the head in ``high``."""

    def __init__(self, low, high, first: int):
        assert 0 < first < low.num_layers, "a split has layers on both sides"
        self.low, self.high, self.first = low, high, first
        self.cfg, self.num_layers, self.vocab_size = low.cfg, low.num_layers, low.vocab_size
        self.device, self.dtype = high.device, high.dtype  # where the logits come out
        self.handovers = 0  # carries handed from the CPU side to the GPU side (one per sequence per pass)

    @property
    def embed_w(self):
        return self.low.embed_w

    def part(self, i: int):
        return self.high if i >= self.first else self.low

    def new_layer_state(self, i: int, max_len: int):
        return self.part(i).new_layer_state(i, max_len)

    def new_state(self, max_len: int) -> SequenceState:
        return SequenceState([self.new_layer_state(i, max_len) for i in range(self.num_layers)])

    def embed(self, ids: torch.Tensor):
        return self.low.embed(ids)

    def attn_part(self, i: int, carry, state: SequenceState):
        if i == self.first:  # the one hand-over of a pass: CPU -> GPU
            carry = hand_over(carry, self.high.device, self.high.dtype)
            self.handovers += 1
        return self.part(i).attn_part(i, carry, state)

    def mlp_part(self, i: int, carry, experts):
        return self.part(i).mlp_part(i, carry, experts)

    def route(self, i: int, carry):
        return self.part(i).route(i, carry)

    def guess_experts(self, i: int, carry) -> list[int]:
        """Layer i's guess from the stream before it, by the side that holds it; none across the hand-over (the
        stream is still on the CPU there)."""
        if i == self.first:
            return []
        return self.part(i).guess_experts(i, carry)

    def head(self, carry) -> torch.Tensor:
        return self.high.head(carry)

    def known_routes(self, ids: torch.Tensor) -> list[tuple[int, list[int]]]:
        """Each side's routes known from the token ids, for the layers it holds."""
        out = []
        for m in (self.low, self.high):
            if hasattr(m, "known_routes"):
                out += [(i, e) for i, e in m.known_routes(ids) if self.part(i) is m]
        return out

    def stack_decode_projections(self) -> None:
        stack = getattr(self.high, "stack_decode_projections", None)
        if stack is not None:
            stack()

    def forward(self, ids: torch.Tensor, state: SequenceState, experts) -> torch.Tensor:
        return forward_parts(self, ids, state, experts)  # [T, V]


class SplitExperts:
    """An ExpertSource over two: layers below ``first`` from ``low`` (host memory, the CPU's expert kernels),
    the rest from ``high`` (the GPU slab). Counters are the two sources' sums."""

    def __init__(self, low, high, first: int):
        self.low, self.high, self.first = low, high, first

    def part_of(self, layer: int):
        """The source that serves ``layer``: ``high`` (the GPU) from ``first`` on, else ``low``."""
        return self.high if layer >= self.first else self.low

    def fetch(self, layer: int, expert_ids: Sequence[int]):
        return self.part_of(layer).fetch(layer, expert_ids)

    def fetch_groups(self, layer: int, expert_ids: Sequence[int]):
        return self.part_of(layer).fetch_groups(layer, expert_ids)

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None:
        self.part_of(layer).prefetch(layer, expert_ids)

    def wants_guess(self, layer: int) -> bool:
        return self.part_of(layer).wants_guess(layer)

    def guess(self, layer: int, expert_ids: Sequence[int], read: bool | None = None) -> None:
        """To the side that serves ``layer``; it reads the guess behind its own next fetch (within a side, the
        layer before)."""
        self.part_of(layer).guess(layer, expert_ids, read)

    @property
    def slab(self):  # moe_dispatch's grouped CUDA kernels read the GPU side's slab
        return self.high.slab

    def math_span(self):
        return self.high.math_span()

    @property
    def checks_where(self) -> str:
        """The GPU side's reads may be checked in its slab, the CPU side's are checked on the host."""
        low, high = self.low.checks_where, self.high.checks_where
        return low if low == high else f"{high}+{low}"

    @property
    def record(self):
        return self.low.record

    @record.setter
    def record(self, v) -> None:
        self.low.record = self.high.record = v  # one list: fetches append in layer order

    @property
    def routes(self):
        return self.low.routes

    @routes.setter
    def routes(self, v) -> None:
        self.low.routes = self.high.routes = v

    @property
    def stats(self) -> SourceStats:
        a, b = self.low.stats, self.high.stats
        out = SourceStats(**{f.name: getattr(a, f.name) + getattr(b, f.name)
                             for f in dataclasses.fields(SourceStats) if f.name != "unique_bytes"})
        out.unique_bytes = a.unique_bytes | b.unique_bytes
        return out

    @property
    def direct(self) -> bool:
        return self.low.direct and self.high.direct

    @property
    def reserved(self) -> tuple[int, int, float]:
        return tuple(x + y for x, y in zip(self.low.reserved, self.high.reserved, strict=True))

    @property
    def cache_bytes(self) -> tuple[int, int]:
        """(host cache budget, GPU cache budget)."""
        return self.low.cache.budget, self.high.cache.budget

    def per_drive(self) -> dict[str, dict]:
        a, b = self.low.per_drive(), self.high.per_drive()
        return {k: {n: v + b[k][n] for n, v in d.items()} for k, d in a.items()}

    def settle_clock(self) -> None:
        self.high.settle_clock()

    def close(self) -> None:
        self.high.close()
        self.low.close()


def cuda_index(device: torch.device) -> int:
    """The device's index (``torch.device("cuda")`` has none: the current device), as the memory cap wants it."""
    return device.index if device.index is not None else torch.cuda.current_device()
