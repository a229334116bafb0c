"""Bounded least-recently-used maps, for every in-memory cache Engram keeps: :class:`LRU` (by
entries) and :class:`SizedLRU` (by the size of what they hold)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
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


class SizedLRU(Generic[K, V]):
    """A dict bounded by the summed ``size_of`` its values (e.g. bytes) rather than by count:
    writing past ``max_size`` drops the least recent entries; a value bigger than ``max_size``
    on its own is not kept (and replaces nothing). ``max_size`` 0 keeps nothing."""

    def __init__(self, max_size: int, size_of: Callable[[V], int]) -> None:
        self.max_size = max(0, max_size)
        self.size_of = size_of
        self.size = 0
        self._data: OrderedDict[K, tuple[V, int]] = OrderedDict()

    def get(self, key: K) -> V | None:
        found = self._data.get(key)
        if found is None:
            return None
        self._data.move_to_end(key)
        return found[0]

    def __getitem__(self, key: K) -> V:
        value, _ = self._data[key]
        self._data.move_to_end(key)
        return value

    def __setitem__(self, key: K, value: V) -> None:
        self.pop(key)
        size = self.size_of(value)
        if size > self.max_size:
            return
        self._data[key] = (value, size)
        self.size += size
        while self.size > self.max_size:
            _, (_, dropped) = self._data.popitem(last=False)
            self.size -= dropped

    def pop(self, key: K) -> V | None:
        found = self._data.pop(key, None)
        if found is None:
            return None
        self.size -= found[1]
        return found[0]

    def clear(self) -> None:
        self._data.clear()
        self.size = 0

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)
