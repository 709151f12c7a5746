"""One rank's writer: a thread that moves the rank's layer snapshots to the store, as the Ray
runtime's persistence pool does, through the same :class:`SupersedingQueue` (every step's shard
is written; see :mod:`layercheck.orchestrator.core.persistence.write_queue`) and the same in-flight byte bound: past
``max_inflight_bytes`` (queued plus being written) the training thread waits, and says so.
Each written shard's receipt (or the news that it failed) goes through the :class:`Mailbox` to
rank 0, whose :class:`~layercheck.orchestrator.core.run_supervisor.RunSupervisor` commits whole versions.

With ``memory_bytes > 0`` the writer also keeps the newest shard files it wrote in a
:class:`~layercheck.orchestrator.core.memory.tier.ShardCache` (the Ray writer actor's in-memory tier): each
file is serialised once, written, then held, so a recovery opens it from memory
(:mod:`layercheck.orchestrator.local.memory`).

A shard it is handed as it is (the loop's snapshot buffers, given away) goes to ``recycle`` once
the writer is done with it, written or superseded: the loop's next snapshot reuses the buffers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from layercheck.orchestrator.core.memory.reads import header_block
from layercheck.orchestrator.core.memory.tier import CacheStats, HeldShard, ShardCache
from layercheck.orchestrator.core.persistence.storage_waits import StorageWaits
from layercheck.orchestrator.core.persistence.write_queue import SupersedingQueue
from layercheck.orchestrator.core.persistence.writer_stats import WriterStats
from layercheck.orchestrator.local.mailbox import Mailbox
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import MEMORY_ORIGIN
from layercheck.workers.shard import LayerShard

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Entry:
    shard: LayerShard
    base: bool
    origin: str = "policy"


class LocalWriter:
    def __init__(self, store: LayerStore, mailbox: Mailbox, *, max_inflight_bytes: int, memory_bytes: int = 0) -> None:
        self.store = store
        self.mailbox = mailbox
        self.max_inflight_bytes = max_inflight_bytes
        self.unbounded = False
        """Set once no step follows (the final save): submissions no longer wait for storage."""
        self.recycle: Callable[[LayerShard], None] | None = None
        """Given each shard once it is written (or its write failed) or superseded: not read again."""
        self.stats = WriterStats()
        self._waits = StorageWaits()
        self._memory = ShardCache(memory_bytes)  # guarded by _changed: the recovery reads it from another thread
        self._queue: SupersedingQueue[_Entry] = SupersedingQueue(lambda e: e.shard.nbytes)
        self._writing_bytes = 0
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="layercheck-writer", daemon=True)
        self._thread.start()

    @property
    def inflight_bytes(self) -> int:
        return self._queue.nbytes + self._writing_bytes

    def submit(self, shard: LayerShard, *, base: bool, origin: str = "policy") -> None:
        """Queue ``shard`` (the writer owns it now); waits while the bytes in flight exceed the bound.
        ``origin="capture"``: a survivor's capture, written next (ahead of the scheduled snapshots
        queued) and never superseding a scheduled snapshot of the same step."""
        with self._changed:
            capture, memory = origin == "capture", origin == MEMORY_ORIGIN
            # a memory version waits for no write but the one in progress, and replaces its
            # predecessor still waiting: at most one of a layer's is queued, whatever the storage
            key = (shard.layer, shard.rank, origin) if memory else (shard.layer, shard.rank, shard.step, origin)
            older = self._queue.put(key, _Entry(shard, base, origin), front=capture or memory)
            if older is not None:
                self.stats.superseded += 1
                logger.info(
                    "%s step %d (rank %d) superseded by step %d before it was written",
                    shard.layer,
                    older.shard.step,
                    shard.rank,
                    shard.step,
                )
                self._done_with(older.shard)
            self._changed.notify_all()
            if self.inflight_bytes <= self.max_inflight_bytes or self.unbounded or memory:
                return
            started = self._waits.begin(shard.rank, self.inflight_bytes, self.max_inflight_bytes)
            while self.inflight_bytes > self.max_inflight_bytes and not self._closed:
                self._changed.wait()
            self._waits.end(started)
            self.stats.blocked_s = self._waits.blocked_s

    def drain(self, timeout_s: float) -> bool:
        """Wait until everything queued is written and its receipt posted; False at the deadline."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while len(self._queue) or self._writing_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.error("writer not drained after %.0fs: %d shard(s) left", timeout_s, len(self._queue))
                    return False
                self._changed.wait(left)
        return True

    def close(self) -> None:
        self.abandon()
        self._thread.join()

    def abandon(self) -> None:
        """Stop taking work without waiting: a writer that did not answer a drain is replaced
        (its thread ends after the write it is stuck in, if that ever returns)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def snapshot_stats(self) -> WriterStats:
        with self._changed:
            return replace(self.stats)

    @property
    def memory_bytes(self) -> int:
        """The in-memory tier's budget (0: off)."""
        return self._memory.budget_bytes

    def held(self, path: str) -> bytes | None:
        """A copy of shard file ``path`` if this writer holds it in memory, else ``None``."""
        with self._changed:
            shard = self._memory.get(path)
            return None if shard is None else bytes(shard.data)

    def held_header(self, path: str) -> tuple[bytes, int] | None:
        """The header block and size of shard file ``path`` if this writer holds it, else ``None``."""
        with self._changed:
            shard = self._memory.get(path)
            block = header_block(shard.data) if shard is not None else b""
            return (block, shard.data.nbytes) if shard is not None and block else None

    def memory_stats(self) -> CacheStats:
        with self._changed:
            return self._memory.stats()

    def _run(self) -> None:
        mailbox = self.mailbox.client()
        while True:
            with self._changed:
                while not len(self._queue) and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
                entry = self._queue.pop()
                assert entry is not None
                self._writing_bytes = entry.shard.nbytes
            self._write(entry, mailbox)
            self._done_with(entry.shard)
            with self._changed:
                self._writing_bytes = 0
                self._changed.notify_all()

    def _done_with(self, shard: LayerShard) -> None:
        if self.recycle is not None:
            self.recycle(shard)

    def _write(self, entry: _Entry, mailbox: Mailbox) -> None:
        shard = entry.shard
        if entry.origin == MEMORY_ORIGIN:  # a memory version: held, never written to storage
            held = self.store.prepare_shard(shard, origin=entry.origin)
            with self._changed:
                self.stats.memory_versions += 1
                self._memory.put(HeldShard.written(held.receipt, held.encoded.data))
            mailbox.post(held.receipt.to_json(), 0.0)
            return
        started = time.monotonic()
        prepared = None
        try:
            if self._memory.enabled:  # serialised once: the same bytes go to storage and stay in memory
                prepared = self.store.prepare_shard(shard, base=entry.base, origin=entry.origin)
                receipt = self.store.write_prepared(prepared)
            else:
                receipt = self.store.write_shard(shard, base=entry.base, origin=entry.origin)
        except Exception as error:  # a full or read-only store must not kill the writer
            self.stats.failures += 1
            what = f"writing {shard.layer} step {shard.step} rank {shard.rank} failed: {error}"
            logger.error("%s", what)
            mailbox.post_failure(what, layer=shard.layer, step=shard.step)
            return
        elapsed = time.monotonic() - started
        with self._changed:  # read together by the coordinator's budget (snapshot_stats)
            self.stats.written_versions += 1
            self.stats.written_bytes += receipt.nbytes
            if entry.origin == "capture":
                self.stats.capture_bytes += receipt.nbytes
            self.stats.write_s += elapsed
            if prepared is not None:  # written: only now may a recovery take it from memory
                self._memory.put(HeldShard.written(receipt, prepared.encoded.data))
        mailbox.post(receipt.to_json(), elapsed)
