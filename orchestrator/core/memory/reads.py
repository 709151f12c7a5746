"""Opening shard files for a recovery: each rank reads the byte ranges of its own slices, from a
writer's memory where one holds the file, else from storage; and counts what it read where.

:class:`MemoryFirstOpener` is the ``opener`` of a :class:`~layercheck.orchestrator.store.layer_store.LayerStore`:
``opener(path)`` returns a :class:`ShardFile`. A version reader reads the header of every rank
file of a version (to learn which file holds which slices) and the tensors of only the files
that hold this rank's slices, so:

* a file's **header** comes from a copy fetched in advance (``headers``: a writer's memory), else
  from storage (two small ranged reads);
* its **body** is fetched only when a tensor of it is read: the whole file from the first copy in
  memory that is whole and self-consistent (its header parses, every tensor matches its
  checksum; the candidates are asked lazily, best first), else by ranged reads from storage of
  exactly the tensors read. A copy that fails the check is skipped, never reported as a corrupt
  version: the file in storage may be sound.

So at the world size a version was written at, a rank moves its own files and the others'
headers: the bytes a recovery reads add up to the composite and its headers, not to the
composite times the world size. :func:`files_to_fetch` says, from the headers, which files a
rank's slices need, so a runtime can start fetching those early. Ray-free: the runtime supplies
``candidates`` and ``headers``.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from layercheck.orchestrator.store import tensorfile
from layercheck.orchestrator.store.errors import ShardFormatError

if TYPE_CHECKING:
    from layercheck.workers.layout import (
        StateLayout,  # (torch: the supervisor, which reads no layout, never imports it)
    )

logger = logging.getLogger(__name__)

#: Where a recovering rank's bytes came from: a writer on its own node, one on another node, storage.
SOURCES = ("memory_local", "memory_remote", "storage")


@dataclass
class LoadSources:
    """Bytes a load read (and shard files whose tensors it read), by source; summed over ranks by
    the supervisor. Headers count as bytes, not as files."""

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

    def add(self, source: str, nbytes: int, *, shard: bool = True) -> None:
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        setattr(self, f"{source}_bytes", getattr(self, f"{source}_bytes") + nbytes)
        if shard:
            setattr(self, f"{source}_shards", getattr(self, f"{source}_shards") + 1)

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def describe_sources(sources: LoadSources, seconds: float) -> str:
    """What a load read where, for a log line: bytes per source, files, and the bandwidth."""
    total = sources.memory_local_bytes + sources.memory_remote_bytes + sources.storage_bytes
    rate = f", {total / seconds / 1e9:.2f} GB/s" if seconds > 0 else ""
    return (
        f"{total / 2**20:.1f} MiB read{rate} — {sources.memory_local_bytes / 2**20:.1f} MiB from memory on its "
        f"node ({sources.memory_local_shards} files), {sources.memory_remote_bytes / 2**20:.1f} MiB from another "
        f"node's ({sources.memory_remote_shards}), {sources.storage_bytes / 2**20:.1f} MiB from storage "
        f"({sources.storage_shards})"
    )


#: ``candidates(path)``: the copies of ``path`` held in memory, best first, as (source, bytes);
#: lazily, so that a first good copy spares asking the others.
Candidates = Callable[[str], Iterable[tuple[str, object]]]


@dataclass(frozen=True)
class HeldHeader:
    """A shard file's header block (its 8-byte length and JSON), fetched from a copy in memory."""

    source: str
    block: bytes
    file_nbytes: int


def header_block(data: bytes | memoryview) -> bytes:
    """The header block at the start of a whole shard file's bytes (empty if it is too short)."""
    view = memoryview(data)
    if len(view) < 8:
        return b""
    (n,) = struct.unpack("<Q", view[:8])
    return bytes(view[: 8 + n]) if 8 + n <= len(view) else b""


@dataclass
class MemoryFirstOpener:
    candidates: Candidates
    open_storage: Callable[[str], pa.NativeFile]
    """Opens ``path`` in storage (``StoreFS.open_input``)."""
    headers: Mapping[str, HeldHeader] = field(default_factory=dict)
    """Headers fetched in advance from the writers' memory, by path."""
    sources: LoadSources = field(default_factory=LoadSources)

    def __call__(self, path: str) -> ShardFile:
        return ShardFile(path, self)


class ShardFile:
    """A shard file as a version reader sees it (``size``, ``read_at``, ``close``): its header
    from memory when fetched in advance (else from storage), its body fetched whole from memory
    on the first read past the header, or read range by range from storage. ``verified``: the
    body is a copy whose every tensor already matched its checksum (no need to check them again)."""

    def __init__(self, path: str, opener: MemoryFirstOpener) -> None:
        self.path = path
        self._opener = opener
        self._header = opener.headers.get(path)
        self._header_end = len(self._header.block) if self._header is not None else 8
        """Bytes at the start that are the header block (until the length is read: its 8 bytes)."""
        self._header_counted = False
        self._body: pa.Buffer | None = None
        self._storage: pa.NativeFile | None = None
        self._body_from_storage = False
        self.verified = False

    def size(self) -> int:
        if self._body is not None:
            return self._body.size
        if self._header is not None:
            return self._header.file_nbytes
        return self._from_storage().size()

    def read_at(self, nbytes: int, offset: int) -> Any:
        if self._body is None and not self._body_from_storage and offset + nbytes <= self._header_end:
            return self._read_header(nbytes, offset)
        if self._body is None and not self._body_from_storage:
            self._fetch_body()
        if self._body is not None:
            return self._body.slice(offset, nbytes)
        return self._read_storage(nbytes, offset)

    def _read_header(self, nbytes: int, offset: int) -> Any:
        if self._header is not None:
            if not self._header_counted:
                self._header_counted = True
                self._opener.sources.add(self._header.source, len(self._header.block), shard=False)
            return self._header.block[offset : offset + nbytes]
        data = self._read_storage(nbytes, offset)
        if offset == 0 and len(data) >= 8:
            (n,) = struct.unpack("<Q", bytes(memoryview(data)[:8]))
            self._header_end = 8 + n
        return data

    def _read_storage(self, nbytes: int, offset: int) -> Any:
        data = self._from_storage().read_at(nbytes, offset)
        self._opener.sources.add("storage", len(data), shard=False)
        return data

    def _fetch_body(self) -> None:
        opener, started = self._opener, time.monotonic()
        try:
            for source, data in opener.candidates(self.path):
                buffer = pa.py_buffer(data)
                problem = whole_shard_problem(pa.BufferReader(buffer), self.path)
                if not problem:  # (its header, if already counted, is not counted twice)
                    opener.sources.add(
                        source, buffer.size - (len(self._header.block) if self._header and self._header_counted else 0)
                    )
                    self._body, self.verified = buffer, True
                    return
                opener.sources.memory_rejected += 1
                logger.warning(
                    "the copy of %s in memory (%s) is unusable (%s); trying the next", self.path, source, problem
                )
        finally:
            opener.sources.memory_fetch_s += time.monotonic() - started
        self._body_from_storage = True
        opener.sources.storage_shards += 1

    def _from_storage(self) -> pa.NativeFile:
        if self._storage is None:
            self._storage = self._opener.open_storage(self.path)
        return self._storage

    def close(self) -> None:
        self._body = None
        if self._storage is not None:
            self._storage.close()
            self._storage = None


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


#: param → the element spans ``[start, end)`` of it that a rank restores.
Needs = Mapping[str, Collection[tuple[int, int]]]


def needed_spans(layout: StateLayout, layers: Iterable[str]) -> dict[str, list[tuple[int, int]]]:
    """The spans of every parameter of ``layers`` that this rank restores (a ``StateLayout``'s
    ``needed`` pieces)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for name in layers:
        for piece in layout[name].needed:
            s = piece.slice
            spans.setdefault(s.name, []).append((s.offset, s.offset + s.length))
    return spans


def files_to_fetch(headers: Mapping[str, HeldHeader], needs: Needs) -> list[str]:
    """The files among ``headers`` that hold any element of ``needs``: the ones a rank's load reads
    tensors of (a header that does not parse is left to the load, which reports it)."""
    wanted = []
    for path, held in headers.items():
        try:
            header = tensorfile.read_header(_HeaderView(held), path=path)
        except ShardFormatError:
            continue
        if any(
            _overlaps(piece.offset, piece.offset + piece.length, needs.get(piece.name, ())) for piece in header.slices
        ):
            wanted.append(path)
    return wanted


def _overlaps(start: int, end: int, spans: Collection[tuple[int, int]]) -> bool:
    return any(a < end and start < b for a, b in spans)


class _HeaderView:
    """A header block read as the start of its file (for :func:`tensorfile.read_header`)."""

    def __init__(self, held: HeldHeader) -> None:
        self._held = held

    def size(self) -> int:
        return self._held.file_nbytes

    def read_at(self, nbytes: int, offset: int) -> bytes:
        if offset + nbytes > len(self._held.block):
            raise ShardFormatError("past the header block")
        return self._held.block[offset : offset + nbytes]

    def close(self) -> None:
        pass
