"""The writers' queue: first in, first out, keyed so that the same item submitted again (a
retried call: same layer, rank and step) replaces the waiting one instead of being written twice.

The writers key by (layer, rank, step) and never drop another step's shard: a rank that did would
keep a step of the layer its peers did not, and no version of it would be whole. Memory is bounded
upstream instead, by the policy's :class:`~layercheck.orchestrator.core.persistence.persist_gate.PersistGate` (at most
``max_versions_in_flight`` versions of a layer handed over and not yet committed)."""

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

    def put(self, key: Hashable, item: T, *, front: bool = False) -> T | None:
        """Queue ``item`` at the back (``front``: next to be written, as a survivor's capture is);
        returns the older item of ``key`` it replaced, if any."""
        older = self._items.pop(key, None)
        if older is not None:
            self.nbytes -= self._size(older)
        self._items[key] = item
        if front:
            self._items.move_to_end(key, last=False)
        self.nbytes += self._size(item)
        return older

    def pop(self) -> T | None:
        """The oldest waiting item, or ``None``."""
        if not self._items:
            return None
        _, item = self._items.popitem(last=False)
        self.nbytes -= self._size(item)
        return item

    def waiting(self) -> list[T]:
        """The waiting items, next first."""
        return list(self._items.values())

    def __len__(self) -> int:
        return len(self._items)
