"""A recovering rank's shard files from the writers' memory: the local runtime's side of
:class:`~layercheck.orchestrator.core.memory.reads.MemoryFirstOpener` (the Ray runtime's is
:mod:`layercheck.orchestrator.runtime.memory_fetch`).

Each rank's writer thread keeps the newest shard files it wrote (``memory_bytes``, see
:mod:`layercheck.orchestrator.local.writer`). A failure under the local runtime ends the training step, not
the rank's process, so the writers keep what they hold — as a Ray writer actor outlives its
trainer on the node. Before the load the ranks exchange, on the side group, first the headers of
the plan's files their writers hold (a rank reads the header of every rank file of a version),
then which files each needs for its own slices, then those files, from the rank whose writer holds
them: at the world size the version was written at, a rank's own writer holds its files and no
file moves. Each rank then opens its files through a ``MemoryFirstOpener`` over what it has, and
storage only for what no writer held. The ranks of a local run share one machine, so every copy
counts as ``memory_local``; a node loss (the Ray runtime's mirror copies) has no local counterpart.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from layercheck.orchestrator.core.memory.reads import HeldHeader, LoadSources, MemoryFirstOpener, Needs, files_to_fetch
from layercheck.orchestrator.local.writer import LocalWriter
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import VersionRecord

logger = logging.getLogger(__name__)


class _Group(Protocol):
    """What the exchange needs of a :class:`~layercheck.orchestrator.local.local_coordinator.LocalCoordinator`."""

    writer: LocalWriter
    store: LayerStore

    def all_gather(self, value: object) -> list[Any]: ...


def version_paths(
    records: Mapping[str, VersionRecord], overlays: Mapping[str, tuple[VersionRecord, ...]] | None = None
) -> list[str]:
    """Every shard file of the composite's versions, whole and overlaid."""
    versions = [*records.values(), *(v for layer in (overlays or {}).values() for v in layer)]
    return [entry.path for record in versions for entry in record.shards]


def exchange_copies(
    group: _Group, paths: Iterable[str], needs: Needs
) -> tuple[dict[str, HeldHeader], dict[str, bytes]]:
    """Collective: the headers of ``paths`` any rank's writer holds, and the whole files among them
    that hold this rank's slices (``needs``), each from the rank whose writer holds it."""
    paths = list(paths)
    mine = {path: held for path in paths if (held := group.writer.held_header(path)) is not None}
    headers: dict[str, HeldHeader] = {}
    for theirs in group.all_gather(mine):
        for path, (block, size) in dict(theirs).items():
            headers.setdefault(path, HeldHeader("memory_local", block, size))
    wanted = files_to_fetch(headers, needs)
    asked = {path for request in group.all_gather([p for p in wanted if p not in mine]) for path in request}
    sent = {path: data for path in sorted(asked & set(mine)) if (data := group.writer.held(path)) is not None}
    copies: dict[str, bytes] = {}
    for theirs in group.all_gather(sent):
        for path, data in dict(theirs).items():
            copies.setdefault(path, data)
    for path in wanted:
        if path in mine and path not in copies and (data := group.writer.held(path)) is not None:
            copies[path] = data
    return headers, copies


def memory_first_store(
    group: _Group,
    records: Mapping[str, VersionRecord],
    overlays: Mapping[str, tuple[VersionRecord, ...]] | None,
    needs: Needs,
) -> tuple[LayerStore, LoadSources]:
    """The run's store opening the composite's shard files from the writers' memory first
    (collective when the writers keep a memory tier: every rank's is configured alike): every
    header, and whole the files holding this rank's slices (``needs``).
    Returns it with the counts of what was read where. Without a memory tier: storage alone."""
    if not group.writer.memory_bytes:
        opener = MemoryFirstOpener(candidates=lambda path: (), open_storage=group.store.fs.open_input)
        return LayerStore(group.store.fs, opener=opener), opener.sources
    paths = version_paths(records, overlays)
    headers, copies = exchange_copies(group, paths, needs)

    def candidates(path: str) -> Iterable[tuple[str, object]]:
        return [("memory_local", copies[path])] if path in copies else []

    opener = MemoryFirstOpener(candidates=candidates, open_storage=group.store.fs.open_input, headers=headers)
    logger.info(
        "%d of the composite's %d shard files are held in the writers' memory; %d hold this rank's slices",
        len(headers),
        len(paths),
        len(copies),
    )
    return LayerStore(group.store.fs, opener=opener), opener.sources
