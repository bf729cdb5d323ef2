"""A least-recently-used set of experts bounded by bytes (what the runtime's expert cache does)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class ByteLRU:
    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget = budget_bytes
        self.used = 0
        self._items: OrderedDict[Hashable, int] = OrderedDict()

    def hit(self, key: Hashable) -> bool:
        """True when ``key`` is cached (and mark it most recently used)."""
        if key in self._items:
            self._items.move_to_end(key)
            return True
        return False

    def insert(self, key: Hashable, nbytes: int) -> None:
        if nbytes > self.budget or key in self._items:
            return
        while self.used + nbytes > self.budget:
            _, old = self._items.popitem(last=False)
            self.used -= old
        self._items[key] = nbytes
        self.used += nbytes

    def __len__(self) -> int:
        return len(self._items)
