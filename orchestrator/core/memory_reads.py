"""Opening shard files for a recovery: from a writer's memory when one holds the file, else from
storage; and counting where each file came from.

:class:`MemoryFirstOpener` is the ``opener`` of a :class:`~layercheck.orchestrator.store.layer_store.LayerStore`:
``opener(path)`` returns a readable file. It asks ``candidates(path)`` for copies held in memory
(the rank's own node first, then other nodes: the caller orders them), takes the first that is a
whole, self-consistent shard file (its header parses and every tensor matches its checksum) and
falls back to storage otherwise. A copy that fails the check is skipped, never reported as a
corrupt version: the file in storage may be sound. The version reader then checks the header
against the manifest exactly as for a stored file. Ray-free: the runtime supplies ``candidates``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import pyarrow as pa

from layercheck.orchestrator.store import tensorfile
from layercheck.orchestrator.store.errors import ShardFormatError

logger = logging.getLogger(__name__)

#: Where a recovering rank's shard file came from: a writer on its own node, one on another node, storage.
SOURCES = ("memory_local", "memory_remote", "storage")


@dataclass
class LoadSources:
    """Shard files (and their bytes) a load opened, by source; summed over ranks by the supervisor."""

    memory_local_bytes: int = 0
    memory_local_shards: int = 0
    memory_remote_bytes: int = 0
    memory_remote_shards: int = 0
    storage_bytes: int = 0
    storage_shards: int = 0
    memory_rejected: int = 0
    """Copies in memory that failed their check (the file came from the next copy, or storage)."""
    memory_fetch_s: float = 0.0
    """Time spent asking writers for copies (hits and misses)."""

    def add(self, source: str, nbytes: int) -> None:
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        setattr(self, f"{source}_bytes", getattr(self, f"{source}_bytes") + nbytes)
        setattr(self, f"{source}_shards", getattr(self, f"{source}_shards") + 1)

    def to_json(self) -> dict[str, float]:
        return asdict(self)


#: ``candidates(path)``: the copies of ``path`` held in memory, best first, as (source, bytes);
#: lazily, so that a first good copy spares asking the others.
Candidates = Callable[[str], Iterable[tuple[str, object]]]


@dataclass
class MemoryFirstOpener:
    candidates: Candidates
    open_storage: Callable[[str], pa.NativeFile]
    """Opens ``path`` in storage (``StoreFS.open_input``)."""
    sources: LoadSources = field(default_factory=LoadSources)

    def __call__(self, path: str) -> pa.NativeFile:
        started = time.monotonic()
        try:
            for source, data in self.candidates(path):
                file = pa.BufferReader(pa.py_buffer(data))
                problem = whole_shard_problem(file, path)
                if not problem:
                    self.sources.add(source, file.size())
                    return file
                self.sources.memory_rejected += 1
                logger.warning("the copy of %s in memory (%s) is unusable (%s); trying the next", path, source, problem)
        finally:
            self.sources.memory_fetch_s += time.monotonic() - started
        file = self.open_storage(path)
        self.sources.add("storage", file.size())
        return file


def whole_shard_problem(file: pa.NativeFile, path: str) -> str:
    """Why ``file`` is not a whole, self-consistent shard file (empty if it is): its header must
    parse and every tensor must match the checksum the header holds for it."""
    try:
        header = tensorfile.read_header(file, path=path)
        for entry in header.entries.values():
            tensorfile.read_entry(file, entry, path=path, count=0)
    except (ShardFormatError, OSError) as error:
        return str(error)
    return ""
