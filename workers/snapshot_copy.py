"""Copying layer snapshots device → host without holding the training stream, and handing them
over in order once their copies have landed.

On CPU (and for any layout whose state is on the host) a snapshot is the plain copy of
:func:`layercheck.workers.layer_state.snapshot_layers`, complete when it returns: it is handed over at once,
as before. On CUDA the :class:`SideStreamCopier` issues the copies into pinned buffers on a side
stream that first waits (on the device) for the training stream's work so far, so the snapshot is
the state after the step it is taken at; it records an event and returns without any host wait.
The training stream goes on with the next forward/backward; the next optimizer step, the first
thing that writes the copied tensors, waits (again on the device) for that event through an
optimizer step pre-hook. The :class:`CopyQueue` hands snapshots over in the order they were
taken, each only once its event has completed: polled after each step, waited for at the end or
when more than ``max_in_flight`` are outstanding.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.layer_state import snapshot_layers
from layercheck.workers.layout import Piece, StateLayout
from layercheck.workers.shard import LayerShard

logger = logging.getLogger(__name__)


class CopyDone(Protocol):
    """What a copy's completion looks like: ``torch.cuda.Event`` has both."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class PendingSnapshot:
    """One decision's shards, copied (or being copied) into host buffers."""

    step: int
    base: bool
    shards: list[LayerShard]
    done: CopyDone | None
    """``None``: the copy was complete when it was issued (the host path)."""
    memory: bool = False
    """A memory version (held by the writers, never stored): handed to ``persist(..., memory=True)``."""


class CopyQueue:
    """Snapshots in flight, handed over first in, first out and only once copied."""

    def __init__(self, max_in_flight: int = 2) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self._queue: deque[PendingSnapshot] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, pending: PendingSnapshot) -> None:
        self._queue.append(pending)

    def ready(self, *, wait: bool = False) -> list[PendingSnapshot]:
        """The snapshots to hand over now, oldest first: every one whose copy is complete up to
        the first that is not; with ``wait`` all of them (waiting for each copy); and, past
        ``max_in_flight`` outstanding, the oldest ones waited for until the rest fit."""
        out: list[PendingSnapshot] = []
        while self._queue:
            head = self._queue[0]
            if head.done is not None and not head.done.query():
                if not wait and len(self._queue) <= self.max_in_flight:
                    break
                head.done.synchronize()
            out.append(self._queue.popleft())
        return out


#: ``snapshot_layers``' ``pieces``: what to copy of each layer where not its owned pieces (a capture).
Pieces = Mapping[str, Sequence[Piece]] | None


class SnapshotCopier(Protocol):
    def copy(
        self, names: Sequence[str], step: int, pool: HostBufferPool, pieces: Pieces = None
    ) -> tuple[list[LayerShard], CopyDone | None]:
        """Issue the copies of ``names``' shards (or ``pieces``) at ``step``; the shards and their completion."""

    def close(self) -> None:
        """Stop guarding the optimizer (the copier is no longer used)."""


class HostCopier:
    """The plain path: the copy is complete (joined) when :meth:`copy` returns."""

    def __init__(self, layout: StateLayout) -> None:
        self.layout = layout

    def copy(
        self, names: Sequence[str], step: int, pool: HostBufferPool, pieces: Pieces = None
    ) -> tuple[list[LayerShard], CopyDone | None]:
        return snapshot_layers(self.layout, names, pool, step=step, pieces=pieces), None

    def close(self) -> None:
        pass


class SideStreamCopier:
    """CUDA: copies on a side stream, ordered after the training stream by events, never by a
    host wait; the next optimizer step waits (on the device) for every copy issued before it."""

    def __init__(self, layout: StateLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._unguarded: list[Any] = []  # copy events the training stream has not yet waited for
        self._hook = layout.optimizer.register_step_pre_hook(self._before_optimizer_step)

    def copy(
        self, names: Sequence[str], step: int, pool: HostBufferPool, pieces: Pieces = None
    ) -> tuple[list[LayerShard], CopyDone | None]:
        training = torch.cuda.current_stream(self.device)
        taken = torch.cuda.Event()
        taken.record(training)  # the state after step ``step``: everything queued so far
        self.stream.wait_event(taken)
        with torch.cuda.stream(self.stream):
            shards = snapshot_layers(self.layout, names, pool, step=step, join=False, pieces=pieces)
        done = torch.cuda.Event()
        done.record(self.stream)
        self._unguarded.append(done)
        return shards, done

    def _before_optimizer_step(self, *_: Any) -> None:
        training = torch.cuda.current_stream(self.device)
        for done in self._unguarded:
            training.wait_event(done)  # the step overwrites what the copy reads
        self._unguarded.clear()

    def close(self) -> None:
        self._before_optimizer_step()
        self._hook.remove()


def state_device(layout: StateLayout) -> torch.device | None:
    """The CUDA device this rank's layer state lives on (``None``: on the host)."""
    masters = (p.master for entry in layout.layers.values() for p in entry.owned)
    return next((m.device for m in masters if m.is_cuda), None)


def wait_done(done: CopyDone | None, timeout_s: float, poll_s: float = 0.002) -> bool:
    """Wait at most ``timeout_s`` for ``done`` (a copy, or queued work); True once it completed.
    Polled, never ``synchronize()``: a GPU that hangs must not hang the caller with it. A sticky
    CUDA error (the device's state is lost) raises here."""
    if done is None:
        return True
    deadline = time.monotonic() + timeout_s
    while not done.query():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def settle(layout: StateLayout, timeout_s: float) -> bool:
    """Wait (bounded, see :func:`wait_done`) until the work queued so far on the training stream
    of this rank's device has run (at once on the host). After a collective was aborted its
    kernel returns and what was queued behind it runs: only then is the state what it will stay."""
    device = state_device(layout)
    if device is None:
        return True
    queued = torch.cuda.Event()
    queued.record(torch.cuda.current_stream(device))
    return wait_done(queued, timeout_s)


def copier_for(layout: StateLayout) -> SnapshotCopier:
    """The side-stream copier where this rank's layer state is on a CUDA device, else the host one."""
    device = state_device(layout)
    if device is None or not hasattr(layout.optimizer, "register_step_pre_hook"):
        return HostCopier(layout)
    logger.info("layer snapshots copy to pinned host memory on a side stream of %s", device)
    return SideStreamCopier(layout, device)


class Handover:
    """Snapshots from a copier, handed to ``persist(shards, base=...)`` in order once copied (a
    memory version to ``persist(shards, base=False, memory=True)``). ``give_away``: ``persist``
    keeps the shards as they are, so their buffers leave the pool (:meth:`HostBufferPool.give`)
    until its holder recycles them, instead of coming back to it once ``persist`` returns."""

    def __init__(
        self,
        copier: SnapshotCopier,
        persist: Callable[..., None],
        pool: HostBufferPool,
        max_in_flight: int = 2,
        *,
        give_away: bool = False,
    ) -> None:
        self.copier = copier
        self.persist = persist
        self.pool = pool
        self.queue = CopyQueue(max_in_flight)
        self.give_away = give_away

    def take(self, names: Sequence[str], step: int, *, base: bool, memory: bool = False) -> None:
        """Snapshot ``names`` at ``step`` and hand over whatever has finished copying."""
        shards, done = self.copier.copy(names, step, self.pool)
        self.queue.push(PendingSnapshot(step=step, base=base, shards=shards, done=done, memory=memory))
        self.flush(wait=False)

    def flush(self, *, wait: bool) -> None:
        """Hand over every snapshot whose copy completed (with ``wait``: all of them)."""
        for pending in self.queue.ready(wait=wait):
            if self.give_away:  # given before the hand-over: the holder may recycle them at once, from its thread
                for shard in pending.shards:
                    self.pool.give(shard)
                self._persist(pending)
                continue
            try:
                self._persist(pending)
            finally:
                for shard in pending.shards:
                    self.pool.release(shard)

    def _persist(self, pending: PendingSnapshot) -> None:
        if pending.memory:
            self.persist(pending.shards, base=False, memory=True)
        else:
            self.persist(pending.shards, base=pending.base)
