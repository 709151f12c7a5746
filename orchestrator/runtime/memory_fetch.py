"""A recovering rank's shard files from the writers' memory: the Ray side of
:class:`~layercheck.orchestrator.core.memory.reads.MemoryFirstOpener`.

The supervisor says once which writers hold which files (:meth:`SupervisorActor.memory_index`, the
rank's own node first). The rank then asks those writers, one call each, for the headers of the
plan's files they hold; from the headers it learns which files hold its own slices and asks for
those files whole at once (the writers send them while the rank reads the ones before). Any
other file is read only as far as its header. A writer that is gone or slow is passed over for
the next copy, or for storage.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import ray

from layercheck.orchestrator.core.memory.reads import HeldHeader, MemoryFirstOpener, Needs, files_to_fetch
from layercheck.orchestrator.runtime.handles import SupervisorHandle, WriterHandle
from layercheck.orchestrator.store.layer_store import LayerStore

logger = logging.getLogger(__name__)

#: How long a rank waits for one writer's copy of a file before it tries the next (or storage).
FETCH_TIMEOUT_S = 30.0


class WriterCopies:
    """``candidates`` for a :class:`MemoryFirstOpener`: the copies ``index`` says writers hold."""

    def __init__(self, index: Mapping[str, list[tuple[str, WriterHandle]]], timeout_s: float = FETCH_TIMEOUT_S) -> None:
        self.index = index
        self.timeout_s = timeout_s
        self._ahead: dict[str, ray.ObjectRef[np.ndarray | None]] = {}

    def headers(self, paths: Iterable[str]) -> dict[str, HeldHeader]:
        """The headers of ``paths`` their first holder has, asked of each writer in one call."""
        by_writer: dict[WriterHandle, tuple[str, list[str]]] = {}
        for path in paths:
            if self.index.get(path):
                source, writer = self.index[path][0]
                by_writer.setdefault(writer, (source, []))[1].append(path)
        refs = {writer.fetch_headers.remote(wanted): source for writer, (source, wanted) in by_writer.items()}
        out: dict[str, HeldHeader] = {}
        for ref, source in refs.items():
            try:
                held = ray.get(ref, timeout=self.timeout_s)
            except Exception as error:  # noqa: BLE001 - a dead or slow writer: its files' headers from storage
                logger.warning("a writer's headers are unavailable (%s)", str(error).splitlines()[0][:200])
                continue
            out.update({path: HeldHeader(source, block, size) for path, (block, size) in held.items()})
        return out

    def prefetch(self, paths: Iterable[str]) -> None:
        """Ask the first holder of each of ``paths`` for the whole file now."""
        for path in paths:
            if self.index.get(path) and path not in self._ahead:
                self._ahead[path] = self.index[path][0][1].fetch.remote(path)

    def __call__(self, path: str) -> Iterator[tuple[str, np.ndarray]]:
        for i, (source, writer) in enumerate(self.index.get(path, ())):
            ref = self._ahead.pop(path, None) if i == 0 else None
            try:
                data = ray.get(ref if ref is not None else writer.fetch.remote(path), timeout=self.timeout_s)
            except Exception as error:  # noqa: BLE001 - a dead or slow writer: the next copy, or storage
                logger.warning("a writer's copy of %s is unavailable (%s)", path, str(error).splitlines()[0][:200])
                continue
            if data is not None:  # None: evicted since the index was taken
                yield source, data


def memory_first_store(
    storage_uri: str, fsync: bool, supervisor: SupervisorHandle, node_id: str, paths: Iterable[str], needs: Needs
) -> tuple[LayerStore, MemoryFirstOpener]:
    """The run's store, opening the plan's shard files (``paths``: the ones this rank reads) from
    the writers' memory first: every header, and whole only the files that hold this rank's slices
    (``needs``), asked for at once. The opener counts what was read where."""
    store = LayerStore.open(storage_uri, fsync=fsync)
    paths = list(paths)
    try:
        index = ray.get(supervisor.memory_index.remote(node_id, paths))
    except Exception as error:  # noqa: BLE001 - recovery from storage alone is still recovery
        logger.warning("cannot learn what the writers hold in memory (%s): loading from storage", error)
        index = {}  # (no writer holds anything, as far as this rank knows)
    copies = WriterCopies(index)
    headers = copies.headers(paths)
    copies.prefetch(files_to_fetch(headers, needs))
    opener = MemoryFirstOpener(candidates=copies, open_storage=store.fs.open_input, headers=headers)
    store.opener = opener
    return store, opener
