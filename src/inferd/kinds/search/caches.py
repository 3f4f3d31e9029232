"""The query path's caches: query embeddings (LRU by text), and results (LRU keyed by the index's
generation, so a write makes every older entry unreachable; the service also clears it on writes)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class CacheStatistics:
    entries: int
    capacity: int
    hits: int
    misses: int


class LRU(Generic[K, V]):
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"an LRU holds 0 or more entries, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[K, V] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: K) -> V | None:
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        if self.capacity == 0:
            return
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def statistics(self) -> CacheStatistics:
        return CacheStatistics(len(self._entries), self.capacity, self.hits, self.misses)
