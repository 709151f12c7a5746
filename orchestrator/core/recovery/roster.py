"""Which Ray Train worker trains which rank, and which waits as a warm spare (``cluster.spares``).

With ``cluster.spares = k`` Ray Train runs ``num_workers + k`` workers, each a replica group of its
own (``cluster.in_place``). ``num_workers`` of them train, as LayerCheck's ranks ``0..n-1``; the
others are spares: they have done their imports and warmed their model code, and wait. When Ray
Train replaces a worker that trained rank ``t`` (it died, or raised), a waiting spare is promoted
to ``t`` at once: it joins the survivors' next process group while Ray Train is still starting the
replacement, which becomes a spare when it is up. Without a spare ready, the replacement trains
``t`` itself, cold, as without spares.

Pure bookkeeping, keyed by Ray Train's world rank (a replacement takes its predecessor's); the
supervisor actor holds one and makes it thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: What a Ray Train worker is told it is (``Role.kind``).
TRAIN, SPARE, END = "train", "spare", "end"


@dataclass(frozen=True)
class Role:
    kind: str
    """``train`` (as LayerCheck rank ``rank``), ``spare`` (wait) or ``end`` (the run is over)."""
    rank: int = -1
    world_size: int = 0
    """The training group's size (``cluster.num_workers``), spares not counted."""


@dataclass
class Roster:
    world_size: int
    """Training ranks (``cluster.num_workers``)."""
    spares: int
    holders: dict[int, int] = field(init=False)
    """Ray Train world rank → the training rank its worker trains (absent: a spare)."""
    waiting: list[int] = field(default_factory=list, init=False)
    """Ray Train world ranks of the spares ready to be promoted, the longest waiting first."""
    promoted: dict[int, int] = field(default_factory=dict, init=False)
    """Spares promoted and not yet told: their Ray Train world rank → training rank."""
    promotions: int = field(default=0, init=False)
    finished: set[int] = field(default_factory=set, init=False)
    """Training ranks that trained to the end."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.spares < 0:
            raise ValueError(f"a roster of {self.world_size} training ranks and {self.spares} spares")
        self.holders = {r: r for r in range(self.world_size)}

    @property
    def ended(self) -> bool:
        return len(self.finished) == self.world_size

    def role(self, worker_rank: int) -> Role:
        """What the worker starting at Ray Train world rank ``worker_rank`` is."""
        self._check(worker_rank)
        self.promoted.pop(worker_rank, None)  # a new worker here: a promotion not taken died with the old one
        if self.ended:
            return Role(END, world_size=self.world_size)
        if worker_rank in self.holders:
            return Role(TRAIN, self.holders[worker_rank], self.world_size)
        return Role(SPARE, world_size=self.world_size)

    def ready(self, worker_rank: int) -> None:
        """The spare at ``worker_rank`` has warmed up and waits."""
        self._check(worker_rank)
        if worker_rank not in self.holders and worker_rank not in self.waiting:
            self.waiting.append(worker_rank)

    def take(self, worker_rank: int) -> Role | None:
        """A waiting spare asks: promoted (``train``), ``end``, or ``None`` (wait on)."""
        if worker_rank in self.promoted:
            return Role(TRAIN, self.promoted.pop(worker_rank), self.world_size)
        if self.ended:
            return Role(END, world_size=self.world_size)
        return None

    def replacing(self, worker_rank: int) -> int | None:
        """Ray Train shuts the worker at ``worker_rank`` down to replace it. If it trained a rank and
        a spare waits, that spare is promoted to the rank: its world rank is returned (and its
        replacement here will be a spare). Else ``None``: a spare lost, or the replacement trains."""
        self._check(worker_rank)
        if worker_rank in self.waiting:
            self.waiting.remove(worker_rank)
        rank = self.holders.get(worker_rank)
        if rank is None or not self.waiting or rank in self.finished:
            return None
        spare = self.waiting.pop(0)
        del self.holders[worker_rank]
        self.holders[spare] = rank
        self.promoted[spare] = rank
        self.promotions += 1
        return spare

    def finish(self, rank: int) -> None:
        """Training rank ``rank`` trained to the end (once all have, the spares are told ``end``)."""
        self.finished.add(rank)

    def _check(self, worker_rank: int) -> None:
        if not 0 <= worker_rank < self.world_size + self.spares:
            raise ValueError(f"Ray Train world rank {worker_rank} is not in a group of {self.world_size + self.spares}")
