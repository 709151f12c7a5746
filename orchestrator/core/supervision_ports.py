"""The two small protocols a :class:`~layercheck.orchestrator.core.run_supervisor.RunSupervisor`
acts through, the policy and the writers, their optional parts, and :class:`LocalPolicy`, the
policy port of a :class:`PolicyService` in the same process. A runtime gives the supervision its
ports: the Ray runtime its actors (``supervisor_actor.py``), the local runtime its replicas and
writer threads (``orchestrator/local/``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from layercheck.orchestrator.core.policy_service import PolicyService


class PolicyPort(Protocol):
    def last_complete_step(self) -> int | None:
        """The last step every rank reported; ``None``: the policy lost its count (a policy actor
        rebuilt after its process died, not restarted since)."""

    def restart(self, *, world_size: int, resume_after: int, persisted_steps: Mapping[str, int]) -> None: ...
    def settled(self, layer: str, version_step: int) -> None:
        """This version committed or never will: the layer may be persisted again (``PersistGate``)."""

    def request_stop(self, reason: str) -> None:
        """Every rank stops after the same step (the flag rides on the decisions)."""


@runtime_checkable
class SetsMemoryPeriod(Protocol):
    """The optional part of a :class:`PolicyPort` whose decisions carry the run's memory-version
    period to the ranks (``persistence.memory_period = "auto"``)."""

    def set_memory_period(self, period: int) -> None:
        """Decisions from the next step the policy completes (measured, with quiet steps) carry ``period``."""


class WritersPort(Protocol):
    def drain(self, deadline_s: float | None) -> tuple[str, ...]:
        """Wait up to ``deadline_s`` until every writer has handed over (through
        :meth:`RunSupervisor.shard_written`) what it holds; the names of those that did not answer."""

    def replace(self, names: tuple[str, ...]) -> None: ...


@runtime_checkable
class KnowsUnfinished(Protocol):
    """The optional part of a :class:`WritersPort` that can say what writers that did not answer a
    drain still hold (the run's final drain counts it lost)."""

    def unfinished(self, names: tuple[str, ...]) -> list[tuple[str, int]]:
        """The versions ``(layer, step)`` of the shards the writers ``names`` have queued, are
        writing, or are having committed."""


@runtime_checkable
class HeldPaths(Protocol):
    """The optional part of a :class:`WritersPort` that can say which shard files its live writers
    hold in memory (a memory version whose files are all gone cannot be planned from)."""

    def held_paths(self) -> set[str]: ...


class LocalPolicy:
    """A :class:`PolicyService` in this process, as a :class:`PolicyPort`."""

    def __init__(self, service: PolicyService) -> None:
        self.service = service

    def last_complete_step(self) -> int:
        return self.service.last_complete_step

    def restart(self, *, world_size: int, resume_after: int, persisted_steps: Mapping[str, int]) -> None:
        self.service.restart(world_size=world_size, resume_after=resume_after, persisted_steps=persisted_steps)

    def settled(self, layer: str, version_step: int) -> None:
        self.service.settled(layer, version_step)

    def request_stop(self, reason: str) -> None:
        self.service.request_stop(reason)

    def set_memory_period(self, period: int) -> None:
        self.service.set_memory_period(period)
