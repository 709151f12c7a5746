"""The writers' queue: first in, first out, except that a newer snapshot of a (layer, rank)
replaces an older one still waiting — so a writer that falls behind holds at most one pending
shard per layer and rank, and memory stays bounded without blocking training."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class SupersedingQueue(Generic[T]):
    def __init__(self, size: Callable[[T], int]) -> None:
        self._size = size
        self._items: OrderedDict[Hashable, T] = OrderedDict()
        self.nbytes = 0
        """Bytes of the items waiting."""

    def put(self, key: Hashable, item: T) -> T | None:
        """Queue ``item`` at the back; returns the older item of ``key`` it replaced, if any."""
        older = self._items.pop(key, None)
        if older is not None:
            self.nbytes -= self._size(older)
        self._items[key] = item
        self.nbytes += self._size(item)
        return older

    def pop(self) -> T | None:
        """The oldest waiting item, or ``None``."""
        if not self._items:
            return None
        _, item = self._items.popitem(last=False)
        self.nbytes -= self._size(item)
        return item

    def __len__(self) -> int:
        return len(self._items)
