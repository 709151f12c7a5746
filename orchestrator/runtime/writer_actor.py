"""A writer actor: one of the run's asynchronous writers that move layer snapshots to the store
(:class:`~layercheck.orchestrator.runtime.writer_pool.WriterPool` keeps them, per node).

Workers hand a snapshot over with :meth:`WriterActor.submit` and go on training; the
call resolves when the shard is written. Every shard handed over is written (see
:mod:`layercheck.orchestrator.core.persistence.write_queue` for why none is dropped); the policy's ``PersistGate`` keeps
the number of a layer's versions in flight bounded when storage falls behind. After writing, the
writer hands the receipt to the supervisor, which commits a version once every rank's shard of it
is in.

Writers are pinned to nodes (the supervisor starts them on demand, ``writers_per_node`` per
node), so a snapshot crosses the node's shared-memory object store, not the network. After each
write a writer tells the policy actor its running totals (bytes, seconds spent writing), without
waiting: the drain bandwidth behind the schedule's write budget.

Each writer also keeps the newest shard files it wrote in memory, within
``persistence.memory_bytes`` (:mod:`layercheck.orchestrator.core.memory.tier`), and sends a copy to a peer
writer on another node where the cluster has one: a recovering rank opens its shards from there
(:mod:`layercheck.orchestrator.runtime.memory_fetch`) and reads storage only for what no memory holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import ray

from layercheck.orchestrator.core.memory.footprint import (
    ENCODING_AT_ONCE,
    FootprintMeter,
    WriterFootprint,
    held_by_kind,
)
from layercheck.orchestrator.core.memory.reads import header_block
from layercheck.orchestrator.core.memory.tier import HeldMeta, HeldShard, ShardCache
from layercheck.orchestrator.core.persistence.write_queue import SupersedingQueue
from layercheck.orchestrator.core.persistence.writer_stats import WriterStats
from layercheck.orchestrator.logs import configure_process_logging
from layercheck.orchestrator.runtime.handles import PolicyHandle, SupervisorHandle, WriterHandle
from layercheck.orchestrator.runtime.wire import WireShard, from_wire
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.lease_term import LeaseTerm
from layercheck.orchestrator.store.manifest import MEMORY_ORIGIN, ShardReceipt
from layercheck.orchestrator.store.tensorfile import file_buffer
from layercheck.workers import faults

logger = logging.getLogger(__name__)

WRITTEN = "written"
SUPERSEDED = "superseded"
#: Mirror copies a writer may have on their way to its peer before it waits for the oldest.
MIRRORS_IN_FLIGHT = 4
#: Calls a writer runs at once. Each ``submit`` holds one until its shard is written, and a write
#: waits for its mirror copy to be taken by the peer writer: with Ray's default (1000) two peers
#: each handed more than that (a node's ranks' step-0 state or memory version: ranks × layers, 8 ×
#: 83 for a 70B model already, more with a backlog) held every call on both sides, and neither
#: admitted the other's ``mirror`` again (``test_writer_backlog.py``). What bounds the hand-overs
#: is the policy's gate and the ranks' in-flight bytes, not this; a waiting call costs a coroutine.
MAX_CALLS = 1_000_000


# ray.remote's typed keyword form lists task options only, not an actor's max_concurrency (which Ray takes)
@ray.remote(num_cpus=0, max_concurrency=MAX_CALLS)  # type: ignore[call-overload]
class WriterActor:
    def __init__(
        self,
        store_uri: str,
        fsync: bool,
        supervisor: SupervisorHandle,
        name: str = "",
        policy: PolicyHandle | None = None,
        memory_bytes: int = 0,
        *,
        lease_valid_until: float | None = None,
    ) -> None:
        configure_process_logging()  # the actor process has no main of ours
        import torch  # noqa: F401 - shards arrive as arrays and become tensors (wire.py): load it now, not at the first write

        self._node_id = ray.get_runtime_context().get_node_id()
        hook = self._in_write if faults.active() else None  # a fault site inside each write (tests)
        self.store = LayerStore.open(store_uri, fsync=fsync, hook=hook)
        if lease_valid_until is not None:  # past it, every write is refused and fails (lease_term.py)
            self.store.term = LeaseTerm(uri=self.store.uri, valid_until=lease_valid_until)
        self.supervisor = supervisor
        self.name = name
        self.policy = policy
        """The policy actor, told this writer's totals after each write (``None``: nobody)."""
        self.stats = WriterStats(name=name)
        self.memory = ShardCache(memory_bytes)
        """The newest shard files this writer wrote (and mirror copies), for recovery from memory."""
        self._peer: WriterHandle | None = None
        """A writer on another node that keeps mirror copies of what this one writes (``None``: none)."""
        self._peer_generation = -1
        """The pool's assignment ``_peer`` came from: an older one, arriving late, is ignored."""
        self._mirrors: deque[tuple[ray.ObjectRef[bool], int]] = (
            deque()
        )  # mirror calls in flight (and their bytes), oldest first
        self._queue: SupersedingQueue[tuple[WireShard, asyncio.Future]] = SupersedingQueue(lambda e: e[0].nbytes)
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._current: WireShard | None = None
        """The shard being written, or handed to the supervisor to commit (see :meth:`unfinished`)."""
        self._encoding_slots = asyncio.Semaphore(ENCODING_AT_ONCE)  # memory versions serialised at once
        self._encoding = 0
        """Bytes of shard files being serialised or written and not yet held (``WriterFootprint``)."""
        self._memory_wires = 0
        """Bytes of memory versions' hand-overs this writer is serialising or waits to (in the object store)."""
        self._meter = FootprintMeter()  # last: the runtime's cost is what this process holds by now

    def _start(self) -> None:
        if self._worker is None:
            self._wake, self._idle = asyncio.Event(), asyncio.Event()
            self._idle.set()
            self._worker = asyncio.get_running_loop().create_task(self._run())

    async def submit(self, wire: WireShard) -> str:
        """Queue one rank's shard; resolves to ``written``, ``superseded`` or ``failed: …``. A memory
        version's shard is held at once, beside the writes (never behind a slow one in the queue)."""
        if wire.origin == MEMORY_ORIGIN:
            return await self._hold_memory_version(asyncio.get_running_loop(), wire)
        return await self._enqueue(wire)

    async def hold(self, wire: WireShard) -> int:
        """Take a survivor's capture (``wire.origin == "capture"``) into this writer's own memory
        and queue it first; resolves, with its byte count, as soon as the copy is held — before it
        is written — so the survivor may exit (its object-store copy dies with it)."""
        owned = dataclasses.replace(wire, arrays={key: _owned_copy(a) for key, a in wire.arrays.items()})
        self.stats.captures_held += 1
        self._enqueue(owned, front=True)  # the write's outcome reaches the supervisor as any write's does
        self._measure()
        return owned.nbytes

    def _enqueue(self, wire: WireShard, *, front: bool = False) -> asyncio.Future:
        self._start()
        assert self._wake is not None and self._idle is not None  # _start made them
        future = asyncio.get_running_loop().create_future()
        older = self._queue.put((wire.layer, wire.rank, wire.step, wire.origin), (wire, future), front=front)
        if older is not None:
            self.stats.superseded += 1
            older[1].set_result(SUPERSEDED)
            logger.info(
                "%s step %d (rank %d) superseded by step %d before it was written",
                wire.layer,
                older[0].step,
                wire.rank,
                wire.step,
            )
        self._count_queue()
        self._idle.clear()
        self._wake.set()
        return future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        wake, idle = self._wake, self._idle
        assert wake is not None and idle is not None  # _start made them before it started this
        while True:
            await wake.wait()
            wake.clear()
            while (entry := self._queue.pop()) is not None:
                self._count_queue()
                await self._write_entry(loop, *entry)
            idle.set()

    async def _write_entry(self, loop: asyncio.AbstractEventLoop, wire: WireShard, future: asyncio.Future) -> None:
        """Write one queued shard. A method of its own so that nothing refers to the shard once it
        is written: a reference left in the loop pinned its hand-over's object-store buffer (the
        rank's whole shard) for as long as the writer then stayed idle."""
        self._current = wire
        future.set_result(await self._write(loop, wire))
        self._current = None

    def _count_queue(self) -> None:
        self.stats.queued, self.stats.queued_bytes = len(self._queue), self._queue.nbytes

    def _in_write(self, event: str, rel: str) -> None:
        """The store's write hook: a fault site mid-write (header written, temporary file open)."""
        current = self._current  # the one shard being written (see _run)
        if event == "partial" and current is not None:
            faults.fault_point(faults.SHARD_WRITE, writer=self.name, node_id=self._node_id, step=current.step, path=rel)

    async def _write(self, loop: asyncio.AbstractEventLoop, wire: WireShard) -> str:
        started = time.monotonic()
        held: HeldShard | None = None
        try:
            if self.memory.enabled:  # serialised once: the same bytes go to storage and stay in memory
                receipt, held = await self._write_and_hold(loop, wire)
            else:
                receipt = await loop.run_in_executor(
                    None, lambda: self.store.write_shard(from_wire(wire), base=wire.base, origin=wire.origin)
                )
        except Exception as error:  # a full or read-only store must not kill the writer
            self.stats.failures += 1
            logger.error("writing %s step %d rank %d failed: %s", wire.layer, wire.step, wire.rank, error)
            await self.supervisor.write_failed.remote(wire.layer, wire.step, wire.rank, str(error))
            return f"failed: {error}"
        elapsed = time.monotonic() - started
        self.stats.written_versions += 1
        self.stats.written_bytes += receipt.nbytes
        self.stats.write_s += elapsed
        if self.policy is not None:  # fire-and-forget: the budget is a hint, never worth a wait
            self.policy.writer_totals.remote(self.name, self.stats.written_bytes, self.stats.write_s)
        if held is not None:
            await self._mirror_out(held)
            held = None  # (if the budget did not take it, its bytes go now)
        self._measure()
        await self.supervisor.shard_written.remote(receipt, elapsed)
        return WRITTEN

    async def _write_and_hold(self, loop: asyncio.AbstractEventLoop, wire: WireShard) -> tuple[ShardReceipt, HeldShard]:
        """Serialise ``wire``'s shard file, write it, then hold the same bytes in memory (written:
        only now may recovery take it from there)."""
        with self._encoding_of(wire.nbytes):
            prepared = await loop.run_in_executor(
                None, lambda: self.store.prepare_shard(from_wire(wire), base=wire.base, origin=wire.origin)
            )
            self._measure()  # (the serialised copy's peak)
            receipt = await loop.run_in_executor(None, self.store.write_prepared, prepared)
            return receipt, self._hold(receipt, prepared.encoded.data)

    async def _hold_memory_version(self, loop: asyncio.AbstractEventLoop, wire: WireShard) -> str:
        """A memory version's shard (``persistence.memory_period``): serialised (off the event loop)
        and held in memory (and mirrored), never written to storage; the supervisor hears of it like
        of a write. It supersedes the layer's previous memory version in the cache. At most
        :data:`ENCODING_AT_ONCE` are serialised at once: each is a copy of a rank's shard until
        held, and a rank hands every layer over at once (without waiting: none is held to the
        in-flight bound), so that bound, not the executor's threads, limits the copies."""
        self._memory_wires += wire.nbytes  # (the call's argument: referenced until it returns)
        try:
            async with self._encoding_slots:
                with self._encoding_of(wire.nbytes):
                    prepared = await loop.run_in_executor(
                        None, lambda: self.store.prepare_shard(from_wire(wire), origin=wire.origin)
                    )
                    self._measure()  # (the serialised copy's peak)
                    receipt, held = prepared.receipt, self._hold(prepared.receipt, prepared.encoded.data)
                    del prepared  # held, or let go: nothing else keeps its bytes
            await self._mirror_out(held)
            del held  # (if the budget did not take it, its bytes go now)
            self.stats.memory_versions += 1
            await self.supervisor.shard_written.remote(receipt, 0.0)
        finally:
            self._memory_wires -= wire.nbytes
        self._measure()
        return WRITTEN

    # ---- the in-memory tier ----------------------------------------------------------------
    def _hold(self, receipt: ShardReceipt, data: Any) -> HeldShard:
        """Hold the shard file ``receipt`` describes (its bytes ``data``) in memory, if it fits."""
        held = HeldShard.written(receipt, data)
        self.memory.put(held)
        return held

    async def _mirror_out(self, held: HeldShard) -> None:
        """A copy of ``held`` to the peer, if there is one (whether or not this writer holds it)."""
        if self._peer is not None:
            await self._send_mirror(held)

    async def _send_mirror(self, held: HeldShard) -> None:
        """Hand a copy to the peer without waiting for it, but with at most
        :data:`MIRRORS_IN_FLIGHT` copies on their way (a slow network must not pile them up)."""
        while len(self._mirrors) >= MIRRORS_IN_FLIGHT:
            try:
                await self._mirrors.popleft()[0]
            except Exception as error:  # the peer died: its node's writers are replaced, peers reassigned
                self.stats.mirror_failures += 1
                logger.warning("writer %s: a mirror copy was lost (%s)", self.name, str(error).splitlines()[0][:200])
        peer = self._peer
        if peer is None:  # the pool took the peer away while this copy waited for room
            return
        self._mirrors.append((peer.mirror.remote(held.meta(), np.frombuffer(held.data, dtype=np.uint8)), held.nbytes))
        self.stats.mirrors_sent += 1

    async def set_peer(self, peer: WriterHandle | None, generation: int) -> None:
        """The writer (on another node) that keeps mirror copies of this one's shards; ``None``: none.
        ``generation`` orders the pool's assignments: the pool sends them from several threads, and
        this actor runs them concurrently, so one computed before a node's writers started may
        arrive after the one that knows them; it is ignored (it left a node's writer unmirrored).
        A new peer first gets copies of the shards this writer holds of its own: written before
        any peer was known (the writers start in any order) or mirrored to a peer since replaced.
        Without them a lost node's early files would be in no memory but its own."""
        if generation <= self._peer_generation:
            return
        self._peer_generation = generation
        changed = peer is not None and peer != self._peer
        self._peer = peer
        if changed:
            for held in self.memory.own_shards():
                if self._peer != peer:
                    return  # reassigned to another peer meanwhile: that assignment sends them
                await self._send_mirror(held)

    def mirror(self, meta: HeldMeta, data: np.ndarray) -> bool:
        """Keep a copy of a shard file another node's writer wrote; True if it is held."""
        owned = _owned_copy(np.asarray(data, dtype=np.uint8)).data  # a memoryview, not of the object store
        held = self.memory.put(HeldShard(**meta, data=owned, mirror=True))
        self._measure()
        return held

    def held(self) -> list[tuple[str, bool]]:
        """``(path, mirror)`` of every shard file held in memory."""
        return list(self.memory.paths())

    def fetch(self, path: str) -> np.ndarray | None:
        """The bytes of shard file ``path`` if held in memory, else ``None``."""
        held = self.memory.get(path)
        return None if held is None else np.frombuffer(held.data, dtype=np.uint8)

    def fetch_headers(self, paths: list[str]) -> dict[str, tuple[bytes, int]]:
        """The header block and size of each of ``paths`` held in memory (a recovering rank reads
        every rank file's header, and the tensors of only its own files)."""
        out = {}
        for path in paths:
            held = self.memory.get(path)
            block = header_block(held.data) if held is not None else b""
            if held is not None and block:
                out[path] = (block, held.data.nbytes)
        return out

    def lease_renewed(self, valid_until: float) -> None:
        """The run's lease was renewed: valid until ``valid_until`` (wall clock)."""
        if self.store.term is not None:
            self.store.term.renewed(valid_until)

    def unfinished(self) -> list[tuple[str, int]]:
        """The versions ``(layer, step)`` of the shards this writer has not finished with: queued,
        being written, or being committed (the run's final drain counts them lost)."""
        wires = [wire for wire, _ in self._queue.waiting()] + ([self._current] if self._current is not None else [])
        return [(wire.layer, wire.step) for wire in wires]

    async def drain(self) -> None:
        """Returns once everything queued so far is written and handed to the supervisor."""
        if self._idle is not None:
            await self._idle.wait()

    def get_stats(self) -> WriterStats:
        memory = self.memory.stats()
        return dataclasses.replace(
            self.stats,
            memory_bytes=memory.held_bytes,
            memory_shards=memory.held_shards,
            mirror_bytes=memory.mirror_bytes,
            memory_evicted=memory.evicted,
            memory_versions_dropped=memory.memory_dropped,
            host=self._measure(),
        )

    # ---- what this writer's host memory holds ----------------------------------------------
    @contextlib.contextmanager
    def _encoding_of(self, nbytes: int) -> Iterator[None]:
        """Counts a shard file of about ``nbytes`` being serialised, until it is held or let go."""
        self._encoding += nbytes
        try:
            yield
        finally:
            self._encoding -= nbytes

    def _measure(self) -> WriterFootprint:
        """What this writer holds, by kind, and its process's memory now (the peaks updated)."""
        wires = [wire for wire, _ in self._queue.waiting()] + ([self._current] if self._current is not None else [])
        copies = sum(w.nbytes for w in wires if w.origin == "capture")  # (hold() copied them out)
        mirrors = [ref for ref, _ in self._mirrors]
        done = set(ray.wait(mirrors, num_returns=len(mirrors), timeout=0, fetch_local=False)[0]) if mirrors else set()
        return self._meter.measure(
            held_by_kind(self.memory),
            encoding_bytes=self._encoding,
            capture_copy_bytes=copies,
            object_store_bytes=sum(w.nbytes for w in wires) - copies + self._memory_wires,
            mirror_sending_bytes=sum(n for ref, n in self._mirrors if ref not in done),
        )


def _owned_copy(array: np.ndarray) -> np.ndarray:
    """A copy of ``array`` in memory of its own (``file_buffer``: given back to the system as soon
    as the copy goes, not kept by an allocator), for bytes that must outlive their object-store
    buffer: a survivor's capture, a mirror copy."""
    owned = np.frombuffer(file_buffer(array.nbytes), dtype=array.dtype).reshape(array.shape)
    np.copyto(owned, array)
    return owned
