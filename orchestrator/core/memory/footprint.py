"""What a writer's host memory holds, by kind, beside what its process really has resident.

A writer actor's resident memory, as ``ps`` or a dashboard shows it (RSS), has two parts:

* **its own memory** (``RssAnon`` + ``RssFile``): the runtime (Ray's worker, torch, pyarrow:
  measured at the writer's start, before it holds anything), the shard files its in-memory tier
  holds (within ``persistence.memory_bytes``: memory versions, copies of the files it wrote,
  mirror copies of another node's), and the copies in flight: shard files serialised and not yet
  held (at most :data:`ENCODING_AT_ONCE` memory versions and the one write in progress) and
  survivors' captures, copied out of the object store until they are written. Each held file has
  memory of its own (``store/tensorfile.py``'s ``file_buffer``), given back to the system when
  it is let go, so this part follows the account to some MiB (what the process grew by after
  its start: its threads' allocator arenas, Python objects);
* **Ray's object store** (``RssShmem``): the ranks' hand-overs the writer reads there in place
  (shared memory of the node's object store, not copied; counted once for the node, and left out
  of a worker's memory by Ray's dashboard). A page once read stays mapped in the writer
  after the object is freed, so this part grows to the object-store pages the writer has ever read,
  up to the store's size; what the writer still *references* there (hand-overs queued, being
  written or serialised, mirror copies on their way to the peer) is :attr:`WriterFootprint.object_store_bytes`.

:class:`WriterFootprint` is the writer's own account, with the process's figures beside it
(:func:`process_memory`, from ``/proc/self/status``; ``None`` where there is no ``/proc``), so
that what is not accounted for shows (:attr:`WriterFootprint.unaccounted_bytes`). Ray-free.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from layercheck.orchestrator.core.memory.tier import ShardCache
from layercheck.orchestrator.store.manifest import MEMORY_ORIGIN

logger = logging.getLogger(__name__)

#: Memory versions a writer serialises at once: each is a copy of one rank's shard until it is held
#: (or let go), so their number, not the ranks' burst of hand-overs, bounds that part of its memory.
ENCODING_AT_ONCE = 2

#: How a writer's resident memory splits (:meth:`WriterFootprint.rss_parts`; the metric's ``part`` label).
RSS_PARTS = ("runtime", "memory_versions", "stored_copies", "mirrors", "in_flight", "unaccounted", "object_store")

_STATUS_FIELDS = {"VmRSS": "rss_bytes", "RssAnon": "anon_bytes", "RssFile": "file_bytes", "RssShmem": "shmem_bytes"}


@dataclass(frozen=True, kw_only=True)
class ProcessMemory:
    """A process's resident memory, by part (``/proc/<pid>/status``)."""

    rss_bytes: int
    anon_bytes: int
    """Private memory: the heap, buffers, the held shard files."""
    file_bytes: int
    """Mapped files: the interpreter's and libraries' code (torch's, Ray's, pyarrow's)."""
    shmem_bytes: int
    """Shared memory: Ray's object store pages this process has mapped and touched."""

    @property
    def own_bytes(self) -> int:
        """What the process itself has resident: all but the object store's shared pages."""
        return self.anon_bytes + self.file_bytes


def process_memory(status: Path = Path("/proc/self/status")) -> ProcessMemory | None:
    """This process's resident memory by part; ``None`` where the system does not say (no ``/proc``)."""
    try:
        text = status.read_text()
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in _STATUS_FIELDS and rest.split():
            values[_STATUS_FIELDS[name]] = int(rest.split()[0]) * 1024  # the kernel says kB
    if len(values) < len(_STATUS_FIELDS):
        return None
    return ProcessMemory(**values)


@dataclass(frozen=True, kw_only=True)
class HeldByKind:
    """The shard-file bytes an in-memory tier holds, by kind."""

    memory_version_bytes: int = 0
    """Memory versions' files (``persistence.memory_period``): held in memory only."""
    stored_copy_bytes: int = 0
    """Copies of files this writer wrote to storage (policy versions, the base, captures)."""
    mirror_bytes: int = 0
    """Copies of files another node's writer wrote (``persistence.memory_mirror``)."""

    @property
    def total_bytes(self) -> int:
        return self.memory_version_bytes + self.stored_copy_bytes + self.mirror_bytes


def held_by_kind(cache: ShardCache) -> HeldByKind:
    """What ``cache`` holds, by kind."""
    versions = stored = mirrors = 0
    for path, mirror in cache.paths():
        held = cache.get(path)
        if held is None:
            continue
        if mirror:
            mirrors += held.nbytes
        elif held.origin == MEMORY_ORIGIN:
            versions += held.nbytes
        else:
            stored += held.nbytes
    return HeldByKind(memory_version_bytes=versions, stored_copy_bytes=stored, mirror_bytes=mirrors)


@dataclass(frozen=True, kw_only=True)
class WriterFootprint:
    """A writer's host memory: its own account by kind, and its process's figures beside it."""

    runtime_bytes: int
    """The process's own resident memory at the writer's start, before it held anything (Ray's
    worker, torch, pyarrow; 0 where the system does not say)."""
    held: HeldByKind
    encoding_bytes: int = 0
    """Shard files serialised and not yet held or let go (a write in progress, memory versions)."""
    capture_copy_bytes: int = 0
    """Survivors' captures copied into the writer's own memory and not yet written."""
    object_store_bytes: int = 0
    """Hand-overs the writer references in Ray's object store, read in place: queued, being
    written or serialised (shared memory, counted in ``process.shmem_bytes`` once read)."""
    mirror_sending_bytes: int = 0
    """Mirror copies this writer put in the object store, on their way to its peer."""
    process: ProcessMemory | None = None
    """The process's resident memory now (``None``: the system does not say)."""
    peak_own_bytes: int = 0
    """The most own resident memory (``ProcessMemory.own_bytes``) seen after any shard it took."""
    peak_unaccounted_bytes: int = 0
    """The most :attr:`unaccounted_bytes` seen after any shard it took."""

    @property
    def in_flight_bytes(self) -> int:
        """The writer's own copies on their way to being held or written."""
        return self.encoding_bytes + self.capture_copy_bytes

    @property
    def accounted_bytes(self) -> int:
        """What the writer's own resident memory should be: runtime + held + in flight."""
        return self.runtime_bytes + self.held.total_bytes + self.in_flight_bytes

    @property
    def unaccounted_bytes(self) -> int | None:
        """Own resident memory beyond :attr:`accounted_bytes` (allocator pages, Python objects);
        ``None`` where the system does not say."""
        return None if self.process is None else self.process.own_bytes - self.accounted_bytes

    def rss_parts(self) -> dict[str, int] | None:
        """The process's resident memory split into :data:`RSS_PARTS`, which sum to it (``None``:
        the system does not say)."""
        if self.process is None or self.unaccounted_bytes is None:
            return None
        return {
            "runtime": self.runtime_bytes,
            "memory_versions": self.held.memory_version_bytes,
            "stored_copies": self.held.stored_copy_bytes,
            "mirrors": self.held.mirror_bytes,
            "in_flight": self.in_flight_bytes,
            "unaccounted": self.unaccounted_bytes,
            "object_store": self.process.shmem_bytes,
        }

    def to_json(self) -> dict[str, int | None]:
        process = self.process
        return {
            "runtime_bytes": self.runtime_bytes,
            "memory_version_bytes": self.held.memory_version_bytes,
            "stored_copy_bytes": self.held.stored_copy_bytes,
            "mirror_bytes": self.held.mirror_bytes,
            "encoding_bytes": self.encoding_bytes,
            "capture_copy_bytes": self.capture_copy_bytes,
            "object_store_bytes": self.object_store_bytes,
            "mirror_sending_bytes": self.mirror_sending_bytes,
            "own_bytes": None if process is None else process.own_bytes,
            "shmem_bytes": None if process is None else process.shmem_bytes,
            "unaccounted_bytes": self.unaccounted_bytes,
            "peak_own_bytes": self.peak_own_bytes,
            "peak_unaccounted_bytes": self.peak_unaccounted_bytes,
        }


class FootprintMeter:
    """A writer's runtime cost (its own resident memory when it starts) and the peaks of its
    process's memory, measured whenever the writer takes a shard (:meth:`measure`)."""

    def __init__(self, read: Callable[[], ProcessMemory | None] = process_memory) -> None:
        self._read = read
        start = read()
        self.runtime_bytes = start.own_bytes if start is not None else 0
        self.peak_own_bytes = 0
        self.peak_unaccounted_bytes = 0

    def measure(
        self,
        held: HeldByKind,
        *,
        encoding_bytes: int,
        capture_copy_bytes: int,
        object_store_bytes: int,
        mirror_sending_bytes: int,
    ) -> WriterFootprint:
        """The writer's footprint now, its process's figures read now; the peaks updated."""
        footprint = WriterFootprint(
            runtime_bytes=self.runtime_bytes,
            held=held,
            encoding_bytes=encoding_bytes,
            capture_copy_bytes=capture_copy_bytes,
            object_store_bytes=object_store_bytes,
            mirror_sending_bytes=mirror_sending_bytes,
            process=self._read(),
        )
        unaccounted = footprint.unaccounted_bytes
        if footprint.process is not None and unaccounted is not None:
            self.peak_own_bytes = max(self.peak_own_bytes, footprint.process.own_bytes)
            self.peak_unaccounted_bytes = max(self.peak_unaccounted_bytes, unaccounted)
        return dataclasses.replace(
            footprint, peak_own_bytes=self.peak_own_bytes, peak_unaccounted_bytes=self.peak_unaccounted_bytes
        )


def host_memory_view(footprints: list[WriterFootprint]) -> dict[str, object]:
    """The writers' host memory for the run's summary: what they hold by kind (summed), and their
    processes' figures (the largest writer's); empty without a footprint (no writer actor)."""
    if not footprints:
        return {}
    views = [f.to_json() for f in footprints]

    def total(key: str) -> int:
        return sum(v[key] or 0 for v in views)

    def largest(key: str) -> int | None:
        values = [value for v in views if (value := v[key]) is not None]
        return max(values) if values else None

    return {
        "writers": len(views),
        **{key: total(key) for key in _SUMMED},
        **{f"{key}_max": largest(key) for key in _LARGEST},
    }


_SUMMED = (
    "memory_version_bytes",
    "stored_copy_bytes",
    "mirror_bytes",
    "encoding_bytes",
    "capture_copy_bytes",
    "object_store_bytes",
    "mirror_sending_bytes",
)
_LARGEST = (
    "runtime_bytes",
    "own_bytes",
    "shmem_bytes",
    "unaccounted_bytes",
    "peak_own_bytes",
    "peak_unaccounted_bytes",
)
