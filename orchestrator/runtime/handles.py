"""The run's Ray actors as the code that holds their handles sees them: one Protocol per actor
(:class:`SupervisorHandle`, :class:`PolicyHandle`, :class:`WriterHandle`), each member the actor's
method as its handle offers it, ``handle.method.remote(...)`` → ``ray.ObjectRef`` of its return.

Ray types a handle's methods loosely (mypy sees an ``@ray.remote`` class as the class itself,
python/mypy#3135), so without these every handle was ``Any`` and every call through it unchecked.
Each member is written as the actor method's signature (``self`` and all) under
:func:`remote_method`: the type check then holds every ``.remote(...)`` call to the method's
parameters and ``ray.get`` to its return type, and ``tests/orchestrator/runtime/test_handles.py``
holds each member to its actor's method, so the two cannot drift apart. A handle becomes one of
these where it is created or looked up (:func:`supervisor_named`, :func:`policy_named`, and the
``.options(...).remote(...)`` that starts each actor): nowhere else.

Nothing here runs on the per-step path: the Protocols cost nothing at run time (a real handle is
Ray's ``ActorHandle``, unwrapped).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, cast

import ray
from ray.actor import ActorHandle

from layercheck.orchestrator.runtime.names import NAMESPACE

if TYPE_CHECKING:
    import numpy as np

    from layercheck.orchestrator.core.accounting import RankStart
    from layercheck.orchestrator.core.memory.tier import HeldMeta
    from layercheck.orchestrator.core.persistence.writer_stats import WriterStats
    from layercheck.orchestrator.core.recovery.capture_window import CaptureReport, HoldOutcome
    from layercheck.orchestrator.core.recovery.events import ResumeInfo
    from layercheck.orchestrator.core.recovery.rendezvous import GroupAddress
    from layercheck.orchestrator.core.recovery.roster import Role
    from layercheck.orchestrator.core.run_status import RunStatus
    from layercheck.orchestrator.runtime.wire import WireShard
    from layercheck.orchestrator.store.manifest import ShardReceipt
    from layercheck.workers.progress import StepProgress

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")


class RemoteMethod(Protocol[P, R]):
    """An actor's method as its handle offers it: ``.remote(...)`` submits the call."""

    def remote(self, *args: P.args, **kwargs: P.kwargs) -> ray.ObjectRef[R]: ...


class RemoteMember(Generic[P, R]):
    """A member of a handle Protocol: read on a handle, the actor's method ``signature`` as a
    :class:`RemoteMethod`. Its signature stays readable (``signature``) for the test that holds it
    to the actor's."""

    def __init__(self, signature: Callable[..., R]) -> None:
        self.signature = signature

    def __get__(self, handle: object, owner: type | None = None) -> RemoteMethod[P, R]:
        raise AttributeError(f"{self.signature.__name__}: a member of a handle Protocol, never of an instance")


def remote_method(signature: Callable[Concatenate[S, P], R]) -> RemoteMember[P, R]:
    """Declares a handle Protocol's member by the actor method's signature."""
    return RemoteMember(signature)


class PolicyHandle(Protocol):
    """A handle of ``policy_actor.PolicyActor``."""

    @remote_method
    def report(
        self,
        step: int,
        rank: int,
        lr: float,
        abs_sums: Mapping[str, float],
        counts: Mapping[str, int],
        measured: bool = True,
    ) -> dict[str, object] | None: ...
    @remote_method
    def writer_totals(self, writer: str, written_bytes: int, write_s: float) -> None: ...
    @remote_method
    def forget_writers(self, writers: Sequence[str]) -> None: ...
    @remote_method
    def schedule_view(self) -> dict[str, object]: ...
    @remote_method
    def missing_reports(self, step: int) -> dict[int, int]: ...
    @remote_method
    def last_complete_step(self) -> int | None: ...
    @remote_method
    def settled(self, layer: str, version_step: int) -> None: ...
    @remote_method
    def set_memory_period(self, period: int) -> None: ...
    @remote_method
    def request_stop(self, reason: str) -> None: ...
    @remote_method
    def restart(self, world_size: int, resume_after: int, persisted_steps: Mapping[str, int]) -> None: ...
    @remote_method
    def metrics_view(self) -> dict[str, Any]: ...
    @remote_method
    def trace(self) -> dict[str, object]: ...


class WriterHandle(Protocol):
    """A handle of ``writer_actor.WriterActor``."""

    # (submit and hold take the shard in the object store: Ray resolves a reference passed as an argument)
    @remote_method
    def submit(self, wire: WireShard | ray.ObjectRef[WireShard]) -> str: ...
    @remote_method
    def hold(self, wire: WireShard | ray.ObjectRef[WireShard]) -> int: ...
    @remote_method
    def set_peer(self, peer: WriterHandle | None, generation: int) -> None: ...
    @remote_method
    def mirror(self, meta: HeldMeta, data: np.ndarray) -> bool: ...
    @remote_method
    def held(self) -> list[tuple[str, bool]]: ...
    @remote_method
    def fetch(self, path: str) -> np.ndarray | None: ...
    @remote_method
    def fetch_headers(self, paths: list[str]) -> dict[str, tuple[bytes, int]]: ...
    @remote_method
    def lease_renewed(self, valid_until: float) -> None: ...
    @remote_method
    def unfinished(self) -> list[tuple[str, int]]: ...
    @remote_method
    def drain(self) -> None: ...
    @remote_method
    def get_stats(self) -> WriterStats: ...


class SupervisorHandle(Protocol):
    """A handle of ``supervisor_actor.SupervisorActor``."""

    @remote_method
    def join(self, rank: int, world_size: int, worker_id: str, engine: str = "") -> ray.ObjectRef[ResumeInfo]: ...
    @remote_method
    def rendezvous(self, rank: int, world_size: int, host: str, port: int, timeout_s: float) -> GroupAddress: ...
    @remote_method
    def in_place_refused(self, rank: int, reason: str, detail: str) -> None: ...
    @remote_method
    def in_place_off(self) -> str | None: ...
    @remote_method
    def role(self, worker_rank: int) -> Role: ...
    @remote_method
    def spare_wait(self, worker_rank: int, timeout_s: float) -> Role: ...
    @remote_method
    def replacing(self, worker_ranks: list[int]) -> list[int]: ...
    @remote_method
    def rank_finished(self, rank: int) -> None: ...
    @remote_method
    def capture_began(self, rank: int, attempt: int) -> None: ...
    @remote_method
    def capture_ended(self, report: CaptureReport) -> None: ...
    @remote_method
    def await_captures(
        self, survivors: list[int], teardown_at: float, failed: list[int], released: dict[int, str] | None = None
    ) -> HoldOutcome: ...
    @remote_method
    def writers_for(self, node_id: str) -> list[WriterHandle]: ...
    @remote_method
    def memory_index(
        self, node_id: str, paths: list[str] | None = None
    ) -> dict[str, list[tuple[str, WriterHandle]]]: ...
    @remote_method
    def loaded(
        self,
        rank: int,
        load_s: float,
        sources: Mapping[str, float] | None = None,
        start: RankStart | None = None,
    ) -> None: ...
    @remote_method
    def version_unusable(self, version_id: str, reason: str) -> None: ...
    @remote_method
    def finish(self, ok: bool, reason: str = "") -> None: ...
    @remote_method
    def shard_written(self, receipt: ShardReceipt, write_s: float) -> None: ...
    @remote_method
    def write_failed(self, layer: str, step: int, rank: int, error: str) -> None: ...
    @remote_method
    def writer_died(
        self, rank: int, node_id: str, writer: WriterHandle, lost: list[tuple[str, int]], error: str
    ) -> list[WriterHandle]: ...
    @remote_method
    def request_stop(self, reason: str) -> None: ...
    @remote_method
    def lease_renewed(self, valid_until: float) -> None: ...
    @remote_method
    def drain(self, timeout_s: float = 120.0) -> list[str]: ...
    @remote_method
    def writer_stats(self) -> list[WriterStats]: ...
    @remote_method
    def memory_view(self) -> dict[str, object]: ...
    @remote_method
    def progress(self, progress: StepProgress) -> None: ...
    @remote_method
    def status(self) -> RunStatus: ...
    @remote_method
    def worth_retrying(self) -> bool: ...
    @remote_method
    def setup_failed(self, message: str) -> None: ...
    @remote_method
    def train_view(self) -> dict[str, float | int | None]: ...
    @remote_method
    def train_reported(self, metrics: dict[str, object]) -> None: ...
    @remote_method
    def train_reports(self) -> list[dict[str, object]]: ...
    @remote_method
    def start_metrics(self, host: str, port: int, refresh_s: float = 1.0) -> str: ...
    @remote_method
    def flush_metrics(self) -> bool: ...


def supervisor_named(name: str) -> SupervisorHandle:
    """The run's supervisor actor, looked up by its name (``names.RunNames.supervisor``)."""
    return cast("SupervisorHandle", ray.get_actor(name, namespace=NAMESPACE))


def policy_named(name: str) -> PolicyHandle:
    """The run's policy actor, looked up by its name (``names.RunNames.policy``)."""
    return cast("PolicyHandle", ray.get_actor(name, namespace=NAMESPACE))


def kill(handle: SupervisorHandle | PolicyHandle | WriterHandle) -> None:
    """``ray.kill`` the actor behind ``handle`` (Ray's own handle; anything else is refused)."""
    if not isinstance(handle, ActorHandle):
        raise TypeError(f"not a Ray actor handle: {handle!r}")
    ray.kill(handle)
