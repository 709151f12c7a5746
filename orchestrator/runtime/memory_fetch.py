"""A recovering rank's shard files from the writers' memory: the Ray side of
:class:`~layercheck.orchestrator.core.memory_reads.MemoryFirstOpener`.

The supervisor says once which writers hold which files (:meth:`Supervisor.memory_index`, the
rank's own node first); each file is then asked of its holders in that order, and a writer that
is gone or slow is passed over for the next copy, or for storage.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import ray

from layercheck.orchestrator.core.memory_reads import MemoryFirstOpener
from layercheck.orchestrator.store.layer_store import LayerStore

logger = logging.getLogger(__name__)

#: How long a rank waits for one writer's copy of a file before it tries the next (or storage).
FETCH_TIMEOUT_S = 30.0


class WriterCopies:
    """``candidates`` for a :class:`MemoryFirstOpener`: the copies ``index`` says writers hold."""

    def __init__(
        self,
        index: Mapping[str, list[tuple[str, Any]]],
        timeout_s: float = FETCH_TIMEOUT_S,
        prefetch: Iterable[str] = (),
    ) -> None:
        self.index = index
        self.timeout_s = timeout_s
        # the files the load will open, asked of their first holder at once: the writers send them
        # while the rank reads the ones before (one at a time, each would wait a round trip and a copy)
        self._ahead = {path: index[path][0][1].fetch.remote(path) for path in prefetch if index.get(path)}

    def __call__(self, path: str) -> Iterator[tuple[str, Any]]:
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
    storage_uri: str, fsync: bool, supervisor: Any, node_id: str, prefetch: Iterable[str] = ()
) -> tuple[LayerStore, MemoryFirstOpener]:
    """The run's store, opening shard files from the writers' memory first (``prefetch``: the
    paths the load will open, asked for at once); the opener counts where each came from."""
    store = LayerStore.open(storage_uri, fsync=fsync)
    try:
        index = ray.get(supervisor.memory_index.remote(node_id))
    except Exception as error:  # noqa: BLE001 - recovery from storage alone is still recovery
        logger.warning("cannot learn what the writers hold in memory (%s): loading from storage", error)
        index = {}
    opener = MemoryFirstOpener(candidates=WriterCopies(index, prefetch=prefetch), open_storage=store.fs.open_input)
    store.opener = opener
    return store, opener
