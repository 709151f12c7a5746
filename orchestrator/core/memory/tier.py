"""The in-memory tier of recovery: a writer's bounded cache of the shard files it wrote.

A writer keeps the exact bytes of each shard file it wrote (and, as a mirror, those a writer on
another node wrote), keyed by the file's store-relative path — unique, it carries a random token —
so a recovering rank can open a shard from memory and every reader, checksum check and
corrupt-shard path of the store works on it unchanged. Storage stays the source of truth: the
cache only ever holds copies of files written there, so evicting one never makes a layer
unrecoverable, it only makes its load slower.

What it holds, and why:

* **the newest shard per (layer, rank, origin)**: a newer one supersedes it at once (recovery
  loads a layer's newest committed version; an older one would only take budget). Captures
  (``origin="capture"``) are kept apart from policy versions, since recovery overlays a capture
  on the whole version below it and needs both;
* **within a byte budget**: past it, copies of files in storage go first, then memory versions
  (``persistence.memory_period``), which live nowhere else; within each, the shard taken at the
  oldest step goes first (mirror copies before own ones at equal steps). Under the staggered
  schedule the oldest layer is the next to be persisted again, so its copy had the least time left
  to serve; a shard larger than the whole budget is not held at all.

A memory version is a promise (a lost rank's slices come back at most ``memory_period`` steps
stale), so one is never dropped for a copy of a stored file, nor for a memory version taken at an
older step. Where the budget cannot hold a layer's newest one even so, the promise is broken for
that layer until its next one is held: counted (``CacheStats.memory_dropped``) and logged, never
silent. ``layercheck.orchestrator.core.memory.budget`` tells a run at its start when its budget
cannot hold a whole memory version.

Ray-free; the writer actor (``orchestrator/runtime/writer_actor.py``) owns one, and so does
each rank's writer thread of the local runtime (``orchestrator/local/writer.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypedDict

from layercheck.orchestrator.store.manifest import MEMORY_ORIGIN, ShardReceipt

logger = logging.getLogger(__name__)


class HeldMeta(TypedDict):
    """What identifies a held shard file, without its bytes (a mirror copy travels as this and the bytes)."""

    path: str
    layer: str
    rank: int
    step: int
    origin: str
    checksum: str


@dataclass(frozen=True, kw_only=True)
class HeldShard:
    """One shard file's bytes and what identifies the version it belongs to."""

    path: str
    """Store-relative path of the file (as in its receipt and the version record)."""
    layer: str
    rank: int
    step: int
    origin: str = "policy"
    """``policy`` (a version the schedule chose, or the base) or ``capture`` (a survivor's hand-over)."""
    checksum: str = ""
    """The receipt's checksum of the file's header block."""
    data: memoryview
    """The file, byte for byte."""
    mirror: bool = False
    """A copy of a file another node's writer wrote (held here so a loss of that node still
    recovers from memory)."""

    @classmethod
    def written(cls, receipt: ShardReceipt, data: Any) -> HeldShard:
        """The shard file ``receipt`` describes, with its bytes ``data`` (what was written)."""
        return cls(
            path=receipt.path,
            layer=receipt.layer,
            rank=receipt.rank,
            step=receipt.step,
            origin=receipt.origin,
            checksum=receipt.checksum,
            data=memoryview(data),
        )

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def meta(self) -> HeldMeta:
        return HeldMeta(
            path=self.path, layer=self.layer, rank=self.rank, step=self.step, origin=self.origin, checksum=self.checksum
        )

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.layer, self.rank, self.origin)

    @property
    def memory_version(self) -> bool:
        """A memory version's shard: held here (and in a mirror) only, never in storage."""
        return self.origin == MEMORY_ORIGIN

    @property
    def keep_order(self) -> tuple[bool, int, bool]:
        """Eviction order, lowest first: copies of stored files before memory versions (storage
        still holds the former, nothing else the latter), then the oldest step, then mirror copies
        before own ones (a worker's loss, which the own copy serves, is the common failure)."""
        return (self.memory_version, self.step, not self.mirror)


@dataclass(frozen=True, kw_only=True)
class CacheStats:
    """What a cache holds now, and what it has let go."""

    budget_bytes: int
    held_bytes: int
    held_shards: int
    mirror_bytes: int
    mirror_shards: int
    evicted: int
    """Shards dropped to stay within the budget (or never taken: larger than the whole budget)."""
    superseded: int
    """Shards dropped because a newer one of the same (layer, rank, origin) arrived."""
    memory_dropped: int = 0
    """Of ``evicted``, memory versions' shards: each left its layer without a held memory version
    (``persistence.memory_period``'s promise broken for it) until the layer's next one is held."""


class ShardCache:
    """A byte-bounded map path → :class:`HeldShard` holding the newest shard per
    (layer, rank, origin). ``budget_bytes == 0`` turns it off (it holds nothing). Not thread-safe:
    the writer actor calls it from its event loop only."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._by_path: dict[str, HeldShard] = {}
        self._by_key: dict[tuple[str, int, str], str] = {}
        self._held = 0
        self._evicted = 0
        self._superseded = 0
        self._memory_dropped = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def put(self, shard: HeldShard) -> bool:
        """Hold ``shard`` unless a newer one of its (layer, rank, origin) is held already; drops
        the older one it supersedes, then, until it fits, the shards before it in
        :attr:`HeldShard.keep_order` (a copy of a stored file never evicts a memory version). True
        if it is held; if it does not fit even so, nothing else is dropped for it."""
        if not self.enabled:
            return False
        current = self._by_path.get(self._by_key.get(shard.key, ""))
        if current is not None and current.step > shard.step:
            self._superseded += 1  # an old version arriving late (a mirror overtaken by a write)
            return False
        if current is not None:
            self._superseded += 1
            self._drop(current.path)
        self._drop(shard.path)  # the same file again (a retried mirror): replaced, not counted twice
        victims = self._victims_for(shard)
        if victims is None:
            self._not_held(shard)
            return False
        for victim in victims:
            self._evict(victim, shard)
        self._by_path[shard.path] = shard
        self._by_key[shard.key] = shard.path
        self._held += shard.nbytes
        return True

    def _victims_for(self, shard: HeldShard) -> list[HeldShard] | None:
        """The shards to drop, in order, so that ``shard`` fits (``None``: it cannot): copies of
        stored files for any shard; for a memory version also memory versions before it in
        :attr:`HeldShard.keep_order`."""
        over = self._held + shard.nbytes - self.budget_bytes
        if over <= 0:
            return []
        if shard.nbytes > self.budget_bytes:
            return None
        candidates = sorted(
            (s for s in self._by_path.values() if not s.memory_version or s.keep_order < shard.keep_order),
            key=lambda s: s.keep_order,
        )
        victims = []
        for candidate in candidates:
            victims.append(candidate)
            over -= candidate.nbytes
            if over <= 0:
                return victims
        return None

    def _evict(self, victim: HeldShard, shard: HeldShard) -> None:
        self._evicted += 1
        self._drop(victim.path)
        if victim.memory_version:
            self._broken(victim, f"evicted to hold {shard.path} (step {shard.step})")
        else:
            logger.debug("evicted %s (step %d) to hold %s", victim.path, victim.step, shard.path)

    def _not_held(self, shard: HeldShard) -> None:
        self._evicted += 1
        why = (
            "larger than the whole budget"
            if shard.nbytes > self.budget_bytes
            else "the budget is taken by memory versions as new as it"
            if shard.memory_version
            else "the budget is taken by memory versions"
        )
        if shard.memory_version:
            self._broken(shard, f"not held ({why})")
        else:
            logger.info("%s (%d bytes) not held in memory: %s", shard.path, shard.nbytes, why)

    def _broken(self, shard: HeldShard, why: str) -> None:
        """A memory version's shard let go for the budget: its layer has none held until the next."""
        self._memory_dropped += 1
        # a budget that cannot hold a whole memory version drops shards at every period: warned at
        # the 1st, 2nd, 4th, 8th ... so a week's run logs a few dozen lines, not one per layer a step
        level = logging.WARNING if self._memory_dropped & (self._memory_dropped - 1) == 0 else logging.DEBUG
        logger.log(
            level,
            "memory version %s of %s (rank %d, step %d, %d bytes) %s; the memory budget of %d bytes cannot hold "
            "every layer's newest memory version (%d dropped so far): that layer's lost slices come back from an "
            "older version (raise persistence.memory_bytes)",
            shard.path,
            shard.layer,
            shard.rank,
            shard.step,
            shard.nbytes,
            why,
            self.budget_bytes,
            self._memory_dropped,
        )

    def get(self, path: str) -> HeldShard | None:
        return self._by_path.get(path)

    def own_shards(self) -> list[HeldShard]:
        """The shards held that this writer wrote itself (not mirror copies), oldest step first."""
        return sorted((s for s in self._by_path.values() if not s.mirror), key=lambda s: s.step)

    def paths(self) -> Iterator[tuple[str, bool]]:
        """``(path, mirror)`` of every shard held."""
        return ((s.path, s.mirror) for s in self._by_path.values())

    def _drop(self, path: str) -> None:
        shard = self._by_path.pop(path, None)
        if shard is not None:
            self._held -= shard.nbytes
            if self._by_key.get(shard.key) == path:
                del self._by_key[shard.key]

    def stats(self) -> CacheStats:
        mirrors = [s for s in self._by_path.values() if s.mirror]
        return CacheStats(
            budget_bytes=self.budget_bytes,
            held_bytes=self._held,
            held_shards=len(self._by_path),
            mirror_bytes=sum(s.nbytes for s in mirrors),
            mirror_shards=len(mirrors),
            evicted=self._evicted,
            superseded=self._superseded,
            memory_dropped=self._memory_dropped,
        )
