"""Warm spares (``cluster.spares``): workers that have done their imports and built their model,
and wait to take a lost rank's place (:mod:`layercheck.orchestrator.core.recovery.roster` decides which).

Three parts meet:

- :class:`SpareRoster`, held by the supervisor: the roster, thread-safe, and a spare's blocking
  wait for its promotion.
- :class:`~layercheck.orchestrator.runtime.in_place.ReplaceInPlace`, a Ray Train callback in the
  controller: when Ray Train shuts a worker down to replace it (``before_replica_group_shutdown``,
  0.2 s after its death), the supervisor promotes a spare to its rank at once, before the
  replacement even starts.
- :func:`wait_as_spare`, in a spare's train function: build the model (the same call a rank makes,
  so the promoted engine is the one a cold start would build) and make the engine's imports, then
  wait for the roster's word. A user's own loop (``layercheck.attach``, the ``Trainer`` callback)
  runs on a spare as far as it goes before it needs its rank or its process group, and waits there
  (:func:`await_promotion`, from :class:`~layercheck.orchestrator.runtime.in_place.Seat`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import ray

from layercheck.orchestrator.core.recovery.roster import END, SPARE, TRAIN, Role, Roster
from layercheck.orchestrator.runtime.handles import SupervisorHandle

logger = logging.getLogger(__name__)

B = TypeVar("B")
"""What a spare's ``build`` builds (its model, engine, ...)."""

#: How long one wait of a spare at the supervisor lasts before it asks again (a Ray call that
#: blocks a supervisor thread; a spare that died meanwhile frees it within this).
SPARE_WAIT_S = 30.0


class SpareRoster:
    """The run's :class:`Roster`, for the supervisor actor's threads."""

    def __init__(self, world_size: int, spares: int) -> None:
        self._roster = Roster(world_size=world_size, spares=spares)
        self._changed = threading.Condition()

    def role(self, worker_rank: int) -> Role:
        with self._changed:
            return self._roster.role(worker_rank)

    def wait(self, worker_rank: int, timeout_s: float) -> Role:
        """A spare that has warmed up waits up to ``timeout_s`` for its promotion (or the run's
        end); ``spare`` if neither came."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            self._roster.ready(worker_rank)
            while (role := self._roster.take(worker_rank)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return Role(SPARE, world_size=self._roster.world_size)
                self._changed.wait(left)
            return role

    def trained(self, worker_ranks: list[int]) -> list[int]:
        """Those of ``worker_ranks`` (Ray Train world ranks) whose workers train a rank now."""
        with self._changed:
            return [w for w in worker_ranks if w in self._roster.holders]

    def replacing(self, worker_ranks: list[int]) -> list[tuple[int, int]]:
        """Ray Train replaces the workers at ``worker_ranks``: ``(spare's world rank, rank)`` of
        each spare promoted to a rank they trained."""
        promoted = []
        with self._changed:
            for worker_rank in worker_ranks:
                spare = self._roster.replacing(worker_rank)
                if spare is not None:
                    promoted.append((spare, self._roster.holders[spare]))
            self._changed.notify_all()
        for spare, rank in promoted:
            logger.warning("the spare at Ray Train rank %d takes over rank %d", spare, rank)
        return promoted

    def finish(self, rank: int) -> None:
        with self._changed:
            self._roster.finish(rank)
            self._changed.notify_all()

    def view(self) -> dict[str, int]:
        with self._changed:
            r = self._roster
            return {"spares": r.spares, "waiting": len(r.waiting), "promotions": r.promotions}


def wait_as_spare(
    supervisor: SupervisorHandle, worker_rank: int, build: Callable[[], B], warm: Callable[[], object] | None = None
) -> tuple[Role, B]:
    """In a spare's train function: ``build()`` (the model, and whatever else a rank builds before
    its group) while nothing is asked of it; from then on the roster may promote it. Then
    ``warm()`` (work its promotion would otherwise do on the critical path: a promotion that comes
    meanwhile waits for its end) and wait until the roster promotes this worker or ends the run.
    Returns the role (``train`` or ``end``) and what ``build`` built."""
    built = build()
    role = ray.get(supervisor.spare_wait.remote(worker_rank, 0.0))  # ready: promotable from here on
    if role.kind != SPARE:  # promoted (or ended) as it got ready: the roster says so once
        return role, built
    if warm is not None:
        warm()
    return await_promotion(supervisor, worker_rank), built


def await_promotion(supervisor: SupervisorHandle, worker_rank: int) -> Role:
    """A spare that has done what it can ahead of a promotion waits at the roster (ready from now
    on, if it was not) until it is promoted (``train``) or the run ends (``end``). The roster says
    a promotion once: a caller that was told it already does not ask again."""
    role = ray.get(supervisor.spare_wait.remote(worker_rank, 0.0))
    logger.info("spare at Ray Train rank %d: warm, waiting", worker_rank)
    while role.kind not in (TRAIN, END):
        role = ray.get(supervisor.spare_wait.remote(worker_rank, SPARE_WAIT_S))
    return role
