"""Memory versions (``persistence.memory_period``): every layer's state, every few steps, held in
the writers' memory and never written to storage, so that a recovery can take a lost rank's
slices from a state fresher than its stored versions (at most ``memory_period`` steps stale).

A rank hands its shards of a memory version to its writer, which serialises and holds them (and
mirrors them to a writer on another node, as any shard it holds); the supervisor hears of each
shard as of a written one. :class:`MemoryVersions` gathers those receipts: once every rank's shard
of a (layer, step) is held, it is a whole version — a :class:`VersionRecord` of origin
``memory`` that no commit record backs. The newest whole one per layer is kept; the recovery plan
weighs it against the stored versions, usable while the writers still hold its files. Pure
bookkeeping: no Ray, no storage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from layercheck.orchestrator.store.fs import new_token
from layercheck.orchestrator.store.manifest import MEMORY_ORIGIN, ShardEntry, ShardReceipt, VersionRecord


@dataclass
class MemoryVersions:
    """The newest whole memory version of each layer, and the receipts of newer ones not whole yet."""

    _whole: dict[str, VersionRecord] = field(default_factory=dict)
    _pending: dict[tuple[str, int, int], dict[int, ShardReceipt]] = field(default_factory=dict)
    held: int = 0
    """Whole memory versions gathered so far."""

    def add(self, receipt: ShardReceipt) -> VersionRecord | None:
        """A rank's shard of a memory version is held; the version, once every rank's is."""
        if receipt.origin != MEMORY_ORIGIN:
            raise ValueError(f"not a memory version's receipt: origin {receipt.origin!r}")
        current = self._whole.get(receipt.layer)
        if current is not None and current.step >= receipt.step:
            return None  # older than the layer's newest whole one
        key = (receipt.layer, receipt.step, receipt.world_size)
        ranks = self._pending.setdefault(key, {})
        ranks[receipt.rank] = receipt
        if len(ranks) < receipt.world_size:
            return None
        del self._pending[key]
        record = VersionRecord(
            version_id=f"{receipt.layer}@{receipt.step:010d}-{MEMORY_ORIGIN}-{new_token()}",
            layer=receipt.layer,
            step=receipt.step,
            world_size=receipt.world_size,
            base=False,
            committed_at=time.time(),
            shards=tuple(
                ShardEntry(rank=r.rank, path=r.path, nbytes=r.nbytes, checksum=r.checksum, slices=r.slices)
                for r in sorted(ranks.values(), key=lambda r: r.rank)
            ),
            origin=MEMORY_ORIGIN,
        )
        self._whole[receipt.layer] = record
        self.held += 1
        for stale in [k for k in self._pending if k[0] == receipt.layer and k[1] <= receipt.step]:
            del self._pending[stale]
        return record

    def records(self) -> list[VersionRecord]:
        """The newest whole memory version of each layer."""
        return list(self._whole.values())

    def forget_after(self, step: int) -> None:
        """A worker group was lost after ``step``: what it held of later steps is no state the run
        continues from."""
        self._whole = {layer: r for layer, r in self._whole.items() if r.step <= step}
        self._pending = {k: v for k, v in self._pending.items() if k[1] <= step}
