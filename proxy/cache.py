"""One bounded least-recently-used map, for every in-memory cache Engram keeps."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """A dict of at most ``capacity`` entries: reading or writing an entry makes it the most
    recent; writing past the capacity drops the least recent. ``capacity`` 0 keeps nothing."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._data: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def __getitem__(self, key: K) -> V:
        value = self._data[key]
        self._data.move_to_end(key)
        return value

    def __setitem__(self, key: K, value: V) -> None:
        if self.capacity == 0:
            return
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.capacity:
            self._data.popitem(last=False)

    def pop(self, key: K) -> V | None:
        """Remove ``key``; its value, or None."""
        return self._data.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)
