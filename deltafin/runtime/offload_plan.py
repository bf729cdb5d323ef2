"""Which trunk layers run on the GPU when the trunk does not fit it: plain Python over byte counts, no torch.

The GPU takes the *last* N layers and the head (final norm, lm_head and the other top-level records the head
reads); the CPU the first L - N layers and the embeddings. A step then hands its activations over once, CPU to
GPU, and its logits come out on the GPU as on the all-GPU path. (llama.cpp's ``-ngl`` also offloads from the
top.) N = L puts the embeddings on the GPU too: the whole trunk, the all-GPU path unchanged. N = 0 is the CPU
path. By default N is as many layers as fit in the budget beside the head and the working memory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from math import prod

from deltafin.errors import UsageError

GB = 1e9
LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")
EMBED = "model.embed_tokens.weight"
ITEM = {"bf16": 2, "f16": 2, "f32": 4}


def record_bytes(fmt: str, shape: Iterable[int]) -> int:
    """Resident bytes of a trunk record of a format and logical shape (as ``QTensor.nbytes`` counts them)."""
    shape = list(shape)
    n = prod(shape)
    if fmt == "int8":
        return n + 4 * (shape[0] if shape else 1)  # a float32 scale per row
    if fmt == "mxfp4":
        return n // 2 + n // 32  # two values a byte, a uint8 scale per 32
    if fmt == "int4g32":
        return n // 2 + n // 32 * 2  # eight values an int32, a bf16 scale per 32
    return ITEM[fmt] * n


def layer_of(name: str) -> int | None:
    """The layer index of a trunk record's name, None for a top-level record (embeddings, head)."""
    m = LAYER_NAME.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, slots=True)
class TrunkSizes:
    """Resident trunk bytes by where they can go: each layer's records, the embedding table, the head."""

    layers: tuple[int, ...]
    embed: int
    head: int  # every other top-level record (with tied embeddings, the table again: the head reads it)

    @property
    def total(self) -> int:
        return sum(self.layers) + self.embed + self.head

    @classmethod
    def from_manifest(cls, tensors: Mapping[str, Mapping], num_layers: int) -> TrunkSizes:
        """From the manifest's ``trunk.tensors`` ({name: {format, shape}})."""
        return cls.from_nbytes({n: record_bytes(t["format"], t["shape"]) for n, t in tensors.items()}, num_layers)

    @classmethod
    def from_nbytes(cls, nbytes: Mapping[str, int], num_layers: int) -> TrunkSizes:
        """From each trunk record's bytes by name."""
        layers, embed, head = [0] * num_layers, 0, 0
        for name, n in nbytes.items():
            i = layer_of(name)
            if i is not None and i < num_layers:
                layers[i] += n
            elif name == EMBED:
                embed += n
            else:
                head += n
        if "lm_head.weight" not in nbytes:
            head += embed  # tied: the head's copy of the table
        return cls(tuple(layers), embed, head)


@dataclass(frozen=True, slots=True)
class OffloadPlan:
    """The last ``gpu_layers`` of ``num_layers`` layers (and the head) on the GPU, the rest on the CPU."""

    num_layers: int
    gpu_layers: int
    gpu_bytes: int
    cpu_bytes: int
    reason: str  # how N was chosen, for the start line

    def __post_init__(self) -> None:
        assert 0 <= self.gpu_layers <= self.num_layers, (self.gpu_layers, self.num_layers)

    @property
    def first_gpu(self) -> int:
        return self.num_layers - self.gpu_layers

    @property
    def all_gpu(self) -> bool:
        return self.gpu_layers == self.num_layers

    @property
    def split(self) -> bool:
        """Layers on both devices (otherwise one device holds the whole trunk)."""
        return 0 < self.gpu_layers < self.num_layers

    def on_gpu(self, layer: int) -> bool:
        return layer >= self.first_gpu

    def describe(self) -> str:
        """'GPU: layers 40-92 + head (31.2 GB), CPU: layers 0-39 + embeddings (26.2 GB)'."""
        from deltafin.fmt import size

        L, f = self.num_layers, self.first_gpu
        if self.all_gpu:
            gpu = f"{_span(0, L - 1)} + embeddings + head ({size(self.gpu_bytes)})"
        else:
            gpu = f"{_span(f, L - 1)} + head ({size(self.gpu_bytes)})" if self.gpu_layers else "none"
        cpu = "none" if self.all_gpu else (f"{_span(0, f - 1)} + embeddings" + ("" if self.gpu_layers else " + head")
                                            + f" ({size(self.cpu_bytes)})")
        return f"GPU: {gpu}, CPU: {cpu} [{self.reason}]"


def _span(a: int, b: int) -> str:
    return f"layer {a}" if a == b else f"layers {a}-{b}"


def _plan(sizes: TrunkSizes, n: int, reason: str) -> OffloadPlan:
    L = len(sizes.layers)
    gpu = 0 if n == 0 else sum(sizes.layers[L - n:]) + sizes.head + (sizes.embed if n == L else 0)
    return OffloadPlan(L, n, gpu, sizes.total - gpu, reason)


def gpu_bytes_for(sizes: TrunkSizes, n: int) -> int:
    """GPU bytes of the trunk with the last n layers there."""
    return _plan(sizes, n, "").gpu_bytes


def most_layers(sizes: TrunkSizes, room: int) -> int:
    """The most layers whose trunk bytes fit in ``room`` bytes (the whole trunk when it fits, else at most
    L - 1 layers: the embeddings stay with layer 0 on the CPU)."""
    L = len(sizes.layers)
    if sizes.total <= room:
        return L
    n, used = 0, sizes.head
    while n < L - 1 and used + sizes.layers[L - 1 - n] <= room:
        used += sizes.layers[L - 1 - n]
        n += 1
    return n if used <= room else 0


def plan_offload(sizes: TrunkSizes, budget: int, headroom: int, gpu_layers: int | None = None,
                 cap_gb: float | None = None, where: str = "the GPU") -> OffloadPlan:
    """Where each trunk layer goes for ``budget`` bytes of GPU memory, ``headroom`` of them kept for working
    memory (activations, caches' first blocks, kernels' workspaces).

    ``gpu_layers`` (--gpu-layers) fixes N; it must fit the budget. Without it N is what fits. ``cap_gb``: the
    --gpu-memory-gb that set the budget, or None (a cap that cannot hold the head and one layer is refused, where
    an uncapped GPU that small runs every layer on the CPU). Raises UsageError naming the option and the fix.
    """
    L, capped = len(sizes.layers), cap_gb is not None
    room = budget - headroom
    if gpu_layers is not None:
        if not 0 <= gpu_layers <= L:
            raise UsageError(f"--gpu-layers {gpu_layers}: this model has {L} layers; give 0 (all on the CPU) to "
                             f"{L} (all on the GPU)")
        plan = _plan(sizes, gpu_layers, "--gpu-layers")
        if plan.gpu_bytes > room:
            fit = most_layers(sizes, room)
            cap = "--gpu-memory-gb" if capped else f"the memory free on {where}"
            raise UsageError(f"--gpu-layers {gpu_layers}: those layers and the head take {_gb(plan.gpu_bytes)} GB "
                             f"plus {_gb(headroom)} GB of working memory, more than {cap} ({_gb(budget)} GB) holds; "
                             f"give --gpu-layers {fit}" + (" or fewer" if fit else "")
                             + (" or raise --gpu-memory-gb" if capped else ""))
        return plan
    n = most_layers(sizes, room)
    if n == 0 and capped:
        need = gpu_bytes_for(sizes, 1) + headroom
        free = "" if budget >= cap_gb * GB else f" ({_gb(budget)} GB of it is free)"
        raise UsageError(f"--gpu-memory-gb {cap_gb:.2f}{free}: the head and the last layer need {_gb(need)} GB on the "
                         f"GPU (with {_gb(headroom)} GB of working memory); give --gpu-memory-gb {_gb(need, up=True)} "
                         f"or more, or --device cpu")
    why = "--gpu-memory-gb" if capped else f"what fits the memory free on {where}"
    return _plan(sizes, n, "the whole trunk fits" if n == L else why)


def _gb(n: float, up: bool = False) -> str:
    """Bytes as GB with two decimals (rounded up with ``up``: a value to give back as an option)."""
    import math

    x = n / GB
    return f"{math.ceil(x * 100) / 100 if up else x:.2f}"


def split_cache(total: int, moe_layers: Iterable[int], plan: OffloadPlan) -> tuple[int, int]:
    """--cache-gb over a split trunk: (GPU bytes, host bytes) in proportion to the MoE layers on each side (each
    layer's experts are cached where the layer computes)."""
    moe = list(moe_layers)
    on_gpu = sum(plan.on_gpu(i) for i in moe)
    gpu = total * on_gpu // len(moe) if moe else 0
    return gpu, total - gpu


def check_offload_args(gpu_layers: int | None, gpu_memory_gb: float | None, device: str) -> None:
    """What --gpu-layers and --gpu-memory-gb can be told apart from the model (before it loads)."""
    import math

    if gpu_layers is not None and gpu_layers < 0:
        raise UsageError(f"--gpu-layers {gpu_layers}: give the number of layers to run on the GPU, 0 or more "
                         f"(e.g. -ngl 40), or leave it out to fit what the GPU holds")
    if gpu_memory_gb is not None and not (math.isfinite(gpu_memory_gb) and gpu_memory_gb > 0):
        raise UsageError(f"--gpu-memory-gb {gpu_memory_gb}: give the GB of GPU memory the engine may use, more "
                         f"than 0 (e.g. --gpu-memory-gb 24)")
    # --gpu-layers 0 (every layer on the CPU) is what any device does
    given = [f for f, v in (("--gpu-layers", gpu_layers or None), ("--gpu-memory-gb", gpu_memory_gb)) if v is not None]
    if given and device not in ("cuda", "auto"):
        raise UsageError(f"{given[0]}: splits the trunk between a CUDA GPU and the CPU; --device {device} has no "
                         f"such split: use --device cuda, or drop {given[0]}")
