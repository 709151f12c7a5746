"""What the training loop needs of the run it belongs to: the :class:`Coordinator` protocol (report
drift, collect a decision, hand snapshots over, report progress) and its optional parts, each a
protocol of its own that :class:`~layercheck.workers.loop.StepProtocol` asks for with
``isinstance``. The Ray runtime (``orchestrator/runtime/ray_coordinator.py``), the local runtime
(``orchestrator/local/local_coordinator.py``) and the tests' fakes implement it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from layercheck.policies.decision import PersistDecision
from layercheck.workers.drift.probe import LayerDrift
from layercheck.workers.progress import StepProgress
from layercheck.workers.shard import LayerShard


class Coordinator(Protocol):
    """What the loop needs of the run: these four methods. Optional, each its own protocol (a
    coordinator only has the members, it need not subclass): :class:`StopsOnRequest` (the run may
    ask every rank to stop) and :class:`CapturesOnFailure` (a survivor's capture is handed over
    when a step raises); :class:`StepProtocol` asks for them with ``isinstance``."""

    def report(self, drift: LayerDrift, lr: float) -> Any:
        """Send this rank's drift for ``drift.step``; return a handle to its decision."""

    def decision(self, handle: Any) -> PersistDecision | None:
        """The decision behind ``handle`` (waits for the other ranks' reports if needed)."""

    def persist(self, shards: Sequence[LayerShard], *, base: bool) -> None:
        """Hand the snapshots over; the shards' buffers may be reused once this returns (unless
        the coordinator keeps them, :class:`KeepsHostBuffers`)."""

    def progress(self, progress: StepProgress) -> None:
        """Rank 0's per-step report to the run's central view."""


@runtime_checkable
class StopsOnRequest(Protocol):
    """The optional part of a :class:`Coordinator` through which the run stops the loop early;
    without it the loop runs to its last step."""

    def stop_requested(self) -> bool:
        """True once the last decision carried the run's request to stop (same on every rank)."""


@runtime_checkable
class KeepsMemoryVersions(Protocol):
    """The optional part of a :class:`Coordinator` that keeps *memory versions*
    (``persistence.memory_period``): after every ``memory_period``-th step the rank hands its
    slices of every layer to be held in the writers' memory, never written to storage, so a lost
    rank's slices come back at most that many steps stale. 0: none. It is the period a rank starts
    with: a decision that carries one (``PersistDecision.memory_period``, the run's choice under
    ``"auto"``) replaces it from the step it is carried out at."""

    @property
    def memory_period(self) -> int: ...

    def hold(self, shards: Sequence[LayerShard]) -> None:
        """Hand a memory version's shards over (the buffers may be reused once this returns)."""


@runtime_checkable
class KeepsHostBuffers(Protocol):
    """The optional part of a :class:`Coordinator` that may keep the shards it is handed as they
    are, in their host buffers, rather than copy them on the training thread: the loop hands them
    over and asks the coordinator not to copy there (one copy of each snapshot on the training
    thread, not two); the coordinator hands each shard back through ``recycle`` once it is done
    with it (written, copied off the training thread, or superseded), so that the next snapshot of
    the layer reuses its buffers instead of allocating new ones."""

    def keep_host_buffers(self, recycle: Callable[[LayerShard], None], *, pinned: bool) -> bool:
        """Whether, from now on, ``persist`` and ``hold`` keep the shards' buffers and pass each
        shard to ``recycle`` (from any thread) once no longer read. ``pinned``: the buffers are
        page-locked, costly to make: a coordinator that would hold them long (until a write to
        storage) declines, and copies out of them as ``persist`` returns."""


@runtime_checkable
class BoundedHandover(Protocol):
    """The optional part of a :class:`Coordinator` whose hand-overs wait for storage while too
    many snapshot bytes are in flight. No step follows the last one, so its snapshots (the final
    save) are not held to that bound: a step is never stalled by them beyond their host copy, and
    the end of the run waits for their writes instead."""

    def steps_ended(self) -> None:
        """No more steps: what is handed over from now on does not wait for storage."""


@runtime_checkable
class SendsInBackground(Protocol):
    """The optional part of a :class:`Coordinator` whose per-step calls leave from a thread of
    their own: when a step raises, what the rank reported before it must still leave (``t_fail``
    is the last step every rank reported)."""

    def wait_sent(self, timeout_s: float) -> bool:
        """Wait (bounded) until every call queued so far has left; False if some had not."""


class CaptureHandover(Protocol):
    """``capture(shards, *, step, error)``: hand a survivor's capture (:mod:`layercheck.workers.capture`)
    over before the rank exits; ``error`` is what the step raised."""

    def __call__(self, shards: Sequence[LayerShard], *, step: int, error: BaseException) -> None: ...


@runtime_checkable
class CapturesOnFailure(Protocol):
    """The optional part of a :class:`Coordinator` that takes a survivor's capture; without it
    (or with ``capture`` ``None``: capture is off) a failure captures nothing."""

    @property
    def capture(self) -> CaptureHandover | None: ...
