"""A recovering rank's shard files from the writers' memory: the local runtime's side of
:class:`~layercheck.orchestrator.core.memory_reads.MemoryFirstOpener` (the Ray runtime's is
:mod:`layercheck.orchestrator.runtime.memory_fetch`).

Each rank's writer thread keeps the newest shard files it wrote (``memory_bytes``, see
:mod:`layercheck.orchestrator.local.writer`). A failure under the local runtime ends the training step, not
the rank's process, so the writers keep what they hold — as a Ray writer actor outlives its
trainer on the node. Before the load the ranks exchange, in one gather on the side group, the
files of the plan's versions their writers hold (a rank reads the header of every rank file of
a version, so each needs all of them); each rank then opens its files through a
``MemoryFirstOpener`` over what it received, and storage only for what no writer held. The
ranks of a local run share one machine, so every copy counts as ``memory_local``; a node loss
(the Ray runtime's mirror copies) has no local counterpart.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from layercheck.orchestrator.core.memory_reads import LoadSources, MemoryFirstOpener
from layercheck.orchestrator.local.writer import LocalWriter
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import VersionRecord

logger = logging.getLogger(__name__)


class _Group(Protocol):
    """What the exchange needs of a :class:`~layercheck.orchestrator.local.coordinator.LocalCoordinator`."""

    writer: LocalWriter
    store: LayerStore

    def all_gather(self, value: object) -> list[Any]: ...


def version_paths(
    records: Mapping[str, VersionRecord], overlays: Mapping[str, tuple[VersionRecord, ...]] | None = None
) -> list[str]:
    """Every shard file of the composite's versions, whole and overlaid."""
    versions = [*records.values(), *(v for layer in (overlays or {}).values() for v in layer)]
    return [entry.path for record in versions for entry in record.shards]


def gather_copies(group: _Group, paths: Iterable[str]) -> dict[str, bytes]:
    """The files of ``paths`` any rank's writer holds in memory, on every rank (collective)."""
    mine = {path: data for path in paths if (data := group.writer.held(path)) is not None}
    copies: dict[str, bytes] = {}
    for theirs in group.all_gather(mine):
        for path, data in dict(theirs).items():
            copies.setdefault(path, data)
    return copies


def memory_first_store(
    group: _Group,
    records: Mapping[str, VersionRecord],
    overlays: Mapping[str, tuple[VersionRecord, ...]] | None = None,
) -> tuple[LayerStore, LoadSources]:
    """The run's store opening the composite's shard files from the writers' memory first
    (collective when the writers keep a memory tier: every rank's is configured alike), and the
    counts of where each file came from. Without a memory tier: the store itself, all from storage."""
    if not group.writer.memory_bytes:
        opener = MemoryFirstOpener(candidates=lambda path: (), open_storage=group.store.fs.open_input)
        return LayerStore(group.store.fs, opener=opener), opener.sources
    copies = gather_copies(group, version_paths(records, overlays))

    def candidates(path: str) -> Iterable[tuple[str, object]]:
        return [("memory_local", copies[path])] if path in copies else []

    opener = MemoryFirstOpener(candidates=candidates, open_storage=group.store.fs.open_input)
    logger.info("%d of the composite's shard files are held in the writers' memory", len(copies))
    return LayerStore(group.store.fs, opener=opener), opener.sources
