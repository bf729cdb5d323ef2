"""The prompt cache: sequence states kept after requests, so a prompt that begins the same way resumes one.

An entry is the state of a sequence after exactly its tokens, with the next-token logits, copied to host
memory. Which entry a new prompt may reuse depends on what the state is made of:

- Per-position state only (KV caches, MLA latent caches): an entry can be cut back to any shorter prefix,
  so a prompt reuses its longest common prefix with any entry.
- Recurrent state (Kimi K3's KDA layers: conv history and the matrix S fold every token into a fixed-size
  tensor): an entry cannot be cut back, so it is reused only whole, when its tokens are a prefix of the
  prompt. Such entries are stored at the end of each prompt (after prefill), at the turn boundary before
  the prompt's last message (just after an end-of-message token) and at the end of each reply: the points
  where a next turn, the same conversation with its last message changed, or another conversation with the
  same system prompt starts from.

Every entry is stored at the end of a reply (prompt + reply tokens fed so far); a later entry that extends
a cuttable one replaces it. A restored prompt still prefills at least its last token, unless an entry holds
exactly the prompt's tokens (its logits then give the first sampled token without a model pass). Entries
stay within a byte budget, least recently used evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deltafin.models.base import SequenceState
from deltafin.models.kda import KDAState
from deltafin.models.layers import GrowingCache, KVCache

# -- one layer's state: frozen copy (host memory), size, cut, restore


def _rows(cache: GrowingCache, n: int) -> torch.Tensor:
    return cache.buf.narrow(cache.axis, 0, n).to("cpu", copy=True)


def freeze_layer(layer, n: int):
    """A host copy of the first ``n`` positions of a layer's state (all of it for recurrent state)."""
    if isinstance(layer, KVCache):
        return ("kv", _rows(layer.keys, n), _rows(layer.values, n))
    if isinstance(layer, GrowingCache):
        return ("rows", _rows(layer, n), layer.axis)
    if isinstance(layer, KDAState):
        return ("kda", layer.conv.to("cpu", copy=True), layer.S.to("cpu", copy=True))
    if hasattr(layer, "freeze"):  # a model's own fixed-size state (DeepSeek-V4's window and compressors)
        return ("own", layer.freeze())
    raise TypeError(f"the prompt cache cannot copy a layer state of type {type(layer).__name__}")


def cuttable(layer) -> bool:
    return isinstance(layer, KVCache | GrowingCache)


def frozen_bytes(frozen) -> int:
    if frozen[0] == "own":
        return frozen[1].nbytes()
    return sum(t.numel() * t.element_size() for t in frozen[1:] if isinstance(t, torch.Tensor))


def thaw_layer(frozen, layer, n: int) -> None:
    """Write the first ``n`` positions of a frozen layer into a fresh layer state of the same kind."""
    kind = frozen[0]
    if kind == "kv":
        _, k, v = frozen
        layer.update(
            k.narrow(1, 0, n).movedim(1, 0).to(layer.k.device),
            v.narrow(1, 0, n).movedim(1, 0).to(layer.v.device),
            0,
        )
    elif kind == "rows":
        _, rows, axis = frozen
        layer.write(0, rows.narrow(axis, 0, n).movedim(axis, 0).to(layer.buf.device))
    elif kind == "own":
        layer.thaw(frozen[1])
    else:
        _, conv, S = frozen
        layer.conv, layer.S = conv.to(layer.conv.device, copy=True), S.to(layer.S.device, copy=True)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


@dataclass(eq=False)
class Entry:
    tokens: tuple[int, ...]
    layers: list
    logits: torch.Tensor  # [V] float32, host: the next-token logits after ``tokens``
    cuttable: bool
    nbytes: int


@dataclass(frozen=True, slots=True)
class Hit:
    entry: Entry
    tokens: int  # prompt tokens the restored state covers
    logits: torch.Tensor | None  # set when ``tokens`` is the whole prompt


@dataclass
class PromptCacheCounters:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    stored: int = 0
    evicted: int = 0


class PromptCache:
    """States of earlier sequences under a byte budget (LRU). Use from the thread that owns the engine."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"prompt cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget = budget_bytes
        self.used = 0
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.counters = PromptCacheCounters()

    def __len__(self) -> int:
        return len(self.entries)

    # -- lookup and restore
    def find(self, prompt: Sequence[int]) -> Hit | None:
        """The entry that covers the most of ``prompt`` under the rule in the module docstring."""
        best: Hit | None = None
        for e in self.entries.values():
            hit = self._usable(e, prompt)
            if hit is not None and (best is None or hit.tokens > best.tokens):
                best = hit
        return best

    @staticmethod
    def _usable(e: Entry, prompt: Sequence[int]) -> Hit | None:
        n, P = common_prefix(e.tokens, prompt), len(prompt)
        if n == len(e.tokens) == P:
            return Hit(e, P, e.logits)
        if not e.cuttable:
            return Hit(e, n, None) if n == len(e.tokens) and n < P else None
        n = min(n, P - 1)  # the last prompt token is fed again for its logits
        return Hit(e, n, None) if n > 0 else None

    def resume(self, prompt: Sequence[int], state: SequenceState) -> tuple[int, torch.Tensor | None]:
        """Restore the best entry for ``prompt`` into the fresh ``state``: (tokens covered, logits when the
        whole prompt is covered, else None). (0, None) and ``state`` untouched when nothing matches."""
        self.counters.lookups += 1
        hit = self.find(prompt)
        if hit is None:
            return 0, None
        assert state.pos == 0, "resume needs a fresh state"
        for frozen, layer in zip(hit.entry.layers, state.layers, strict=True):
            thaw_layer(frozen, layer, hit.tokens)
        state.pos = hit.tokens
        self.entries.move_to_end(hit.entry.tokens)
        self.counters.hits += 1
        self.counters.reused_tokens += hit.tokens
        logits = None if hit.logits is None else hit.logits.clone()
        return hit.tokens, logits

    # -- store
    def cuttable_state(self, state: SequenceState) -> bool:
        return all(cuttable(layer) for layer in state.layers)

    def store(self, tokens: Sequence[int], state: SequenceState, logits: torch.Tensor) -> bool:
        """Keep a copy of ``state`` (which has consumed exactly ``tokens``) and its next-token ``logits``.
        False when it cannot fit the budget at all."""
        tokens = tuple(tokens)
        assert state.pos == len(tokens), f"state at position {state.pos} for {len(tokens)} tokens"
        if not tokens:
            return False
        old = self.entries.get(tokens)
        if old is not None:
            self.entries.move_to_end(tokens)
            return True
        layers = [freeze_layer(layer, len(tokens)) for layer in state.layers]
        lg = logits.detach().to("cpu", dtype=torch.float32, copy=True)
        nbytes = sum(frozen_bytes(f) for f in layers) + lg.numel() * 4
        if nbytes > self.budget:
            return False
        entry = Entry(tokens, layers, lg, self.cuttable_state(state), nbytes)
        if entry.cuttable:  # an entry it extends is now redundant (any prefix can be cut from this one)
            for key in [k for k, e in self.entries.items() if e.cuttable and tokens[: len(k)] == k]:
                self._drop(key)
        while self.used + nbytes > self.budget:
            self._drop(next(iter(self.entries)))
            self.counters.evicted += 1
        self.entries[tokens] = entry
        self.used += nbytes
        self.counters.stored += 1
        return True

    def _drop(self, key: tuple[int, ...]) -> None:
        self.used -= self.entries.pop(key).nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.used = 0
