"""Where the ranks of an in-place run meet to form their training process group.

With ``cluster.in_place``, Ray Train forms no process group across the workers (each is a replica
group of its own, ``orchestrator/runtime/in_place.py``), so the ranks form one here, a generation
at a time: every rank arrives with an address it could serve the group's store from; once all
``world_size`` ranks of a generation are in, each is answered with rank 0's address and the
generation's number. A survivor of a lost peer arrives again in its own process, the peer's
replacement arrives fresh, and the next generation forms from them.

An arrival while its generation is still open replaces the same rank's earlier one (a process
that arrived and died before the group formed). A group of another size starts a new generation.
Thread-safe: the supervisor actor calls it from its own threads, one blocked call per rank.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


class RendezvousTimeout(TimeoutError):
    """Not every rank of the generation arrived in time."""


@dataclass(frozen=True)
class GroupAddress:
    """What every rank of a generation is told: where rank 0 serves the store, and the group."""

    generation: int
    host: str
    port: int
    world_size: int


class Rendezvous:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._generation = 1
        """The generation now forming (the first is 1)."""
        self._world_size = 0
        self._arrived: dict[int, tuple[str, int]] = {}
        self._formed: dict[int, GroupAddress] = {}

    def arrive(self, rank: int, world_size: int, host: str, port: int, *, timeout_s: float) -> GroupAddress:
        """Rank ``rank`` of a group of ``world_size`` is ready to form the next process group,
        serving its store at ``host:port`` if it is rank 0; returns once all ranks are in.
        Raises :class:`RendezvousTimeout` after ``timeout_s``."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of {world_size}")
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if world_size != self._world_size:  # Ray Train resized the group: a new generation
                if self._arrived:
                    self._generation += 1
                self._world_size, self._arrived = world_size, {}
            generation = self._generation
            self._arrived[rank] = (host, port)
            if len(self._arrived) == world_size:
                host0, port0 = self._arrived[0]
                self._formed[generation] = GroupAddress(generation, host0, port0, world_size)
                self._generation, self._arrived = generation + 1, {}
                self._lock.notify_all()
            while generation not in self._formed:
                left = deadline - time.monotonic()
                if left <= 0 or not self._lock.wait(left):
                    if generation in self._formed:
                        break
                    current = generation == self._generation
                    missing = sorted(set(range(world_size)) - set(self._arrived)) if current else []
                    if current:
                        self._arrived.pop(rank, None)  # gone: a late peer must not form a group with it
                    raise RendezvousTimeout(
                        f"rank {rank}: the process group of generation {generation} did not form in {timeout_s:g}s"
                        + (f" (ranks {missing} never arrived)" if missing else "")
                    )
            return self._formed[generation]

    @property
    def generation(self) -> int:
        """The newest generation formed (0: none yet)."""
        with self._lock:
            return self._generation - 1
