"""The expert cache: a byte budget over decoded experts, with a pluggable eviction policy."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol


class Policy(Protocol):
    def touch(self, key: Hashable) -> None: ...
    def insert(self, key: Hashable) -> None: ...
    def remove(self, key: Hashable) -> None: ...
    def victim(self) -> Hashable: ...


class LRU:
    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def touch(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def insert(self, key: Hashable) -> None:
        self._order[key] = None

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self) -> Hashable:
        return next(iter(self._order))


POLICIES: dict[str, Callable[[], Policy]] = {"lru": LRU}


@dataclass
class _Entry:
    value: object
    nbytes: int
    release: Callable[[], None] | None


class ExpertCache:
    """Keeps decoded experts within ``budget`` bytes; evicted entries give their buffers back."""

    def __init__(self, budget: int, policy: str = "lru"):
        if budget < 0:
            raise ValueError(f"cache budget must be >= 0 bytes, got {budget}")
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; known: {', '.join(POLICIES)}")
        self.budget = budget
        self.used = 0
        self.policy = POLICIES[policy]()
        self._entries: dict[Hashable, _Entry] = {}
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> object | None:
        e = self._entries.get(key)
        if e is None:
            self.misses += 1
            return None
        self.hits += 1
        self.policy.touch(key)
        return e.value

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def put(self, key: Hashable, value: object, nbytes: int, release: Callable[[], None] | None = None) -> bool:
        """Insert; returns False (and keeps nothing) when the entry cannot fit the budget at all."""
        if nbytes > self.budget or key in self._entries:
            return False
        while self.used + nbytes > self.budget:
            self._evict(self.policy.victim())
        self._entries[key] = _Entry(value, nbytes, release)
        self.policy.insert(key)
        self.used += nbytes
        return True

    def victim(self) -> Hashable | None:
        """The key the policy would evict next (None when empty)."""
        return self.policy.victim() if self._entries else None

    def evict(self, key: Hashable) -> None:
        self._evict(key)

    def _evict(self, key: Hashable) -> None:
        e = self._entries.pop(key)
        self.policy.remove(key)
        self.used -= e.nbytes
        if e.release:
            e.release()

    def clear(self) -> None:
        for key in list(self._entries):
            self._evict(key)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0
