"""Kernels warmed at load: a throwaway pass so the first prompt does not pay for loading them.

On CUDA each Triton kernel (and each lazily loaded CUDA module of torch's) is loaded on its first call: on an
8-layer Kimi K3 slice the first prompt's trunk math took 2.65 s against 1.31 s warm, and its time to first token
5.68 s against 5.03-5.19 s (1.22x against 1.08-1.11x its read floor; docs/BENCHMARKS.md). The engine
runs two short prompts (one of 16 tokens, one of 17, which Triton specialises apart) and one decode token through a
state it then drops, with every expert of a layer served by one expert read once per expert shape: the kernels
see the real shapes and formats, the drives read a few experts, and nothing a later run computes changes (the
weights and caches are not written; the state is thrown away). As llama.cpp does, on by default;
``--no-warmup`` turns it off.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator, Sequence

import torch

log = logging.getLogger(__name__)
WARM_PROMPTS = (16, 17)  # token counts of the throwaway prompts: a multiple of 16 and one that is not


class OneExpertSource:
    """Every requested expert of a layer answered with one expert actually read (the first the layer asks for,
    kept per expert file size): the kernels run at the layer's real shape without reading the layer."""

    def __init__(self, source, packed):
        self.source, self.packed = source, packed
        self._held: dict[tuple, dict] = {}  # (expert file bytes, side) -> the tensors of the expert read for them

    def __getattr__(self, name):  # slab, math_span, checks_where...: the source's own
        return getattr(self.source, name)

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None:  # nothing read ahead for a throwaway pass
        return None

    def wants_guess(self, layer: int) -> bool:  # nor guessed (``guess`` would read and score the real source)
        return False

    def _one(self, layer: int, first: int) -> dict:
        side = getattr(self.source, "part_of", None)  # a split trunk: the GPU's slab or the host's cache
        key = (self.packed.file_bytes(layer), id(side(layer)) if side else 0)
        if key not in self._held:
            (_, tensors), = list(self.source.fetch(layer, [first]))
            self._held[key] = tensors
        return self._held[key]

    def fetch(self, layer: int, expert_ids: Sequence[int]) -> Iterator[tuple[int, dict]]:
        tensors = self._one(layer, expert_ids[0])
        for e in expert_ids:
            yield e, tensors

    def fetch_groups(self, layer: int, expert_ids: Sequence[int]) -> Iterator[list[tuple[int, dict]]]:
        yield list(self.fetch(layer, expert_ids))


def warm(engine) -> float:
    """Run the throwaway passes on ``engine``; returns the seconds they took. The expert cache keeps the few
    experts read (real ones, under their own keys); the source's counters (``SourceStats``) are put back as they
    were, while its per-drive totals keep the warmup's reads (a run reports its own deltas of those)."""
    from deltafin.runtime.batch import forward_batch

    src = engine.source
    parts = [src.low, src.high] if hasattr(src, "part_of") else [src]
    before = [copy.deepcopy(p.stats) for p in parts]
    one = OneExpertSource(src, engine.packed)
    t0 = time.perf_counter()
    vocab = int(engine.packed.text_config["vocab_size"])
    # no_grad, not inference_mode: what the passes create and keep (the expert slab on CUDA, at its first read)
    # must stay writable by callers that run the model outside inference mode
    with torch.no_grad():
        for n in WARM_PROMPTS:
            state = engine.model.new_state(engine.opts.max_len)  # the runs' own length: kernels specialise on it
            ids = torch.arange(1, n + 1, device=engine.device) % vocab
            forward_batch(engine.model, [(ids, state)], one)
            forward_batch(engine.model, [(ids[:1], state)], one)  # a decode token after the prompt
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    for p, b in zip(parts, before, strict=True):
        p.stats = b
    seconds = time.perf_counter() - t0
    log.info("kernels warmed in %.2f s (--no-warmup skips this)", seconds)
    return seconds
