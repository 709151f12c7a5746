"""Versions handed to the writers and not settled yet: neither committed nor known failed or lost.

Rank 0 says, with its progress after each step, which layers it handed over as versions of that
step (every rank hands over the same ones). The commit path settles them: a commit of the layer
at that step or later, a failed write of one of its shards, a commit given up, a writer that
died with it, a lost worker group. What is left is storage's backlog; its oldest version, and
how long storage has left it unanswered, is what tells storage that does not answer (an endpoint
that accepts connections and never replies, a hung mount) from storage that is merely slow
(:mod:`~layercheck.orchestrator.core.persistence.staleness_guard`).

"Unanswered" counts from the version's hand-over or from the last commit, whichever is later: a
slow store keeps committing other versions while one waits in a writer's queue behind them, and
that wait is the queue's length, not a hang. A store that hangs commits nothing at all.

API::

    unwritten = UnwrittenVersions()
    unwritten.handed_over(["embed"], step=40, at=clock(), newest={"embed": 20})
    unwritten.committed("embed", 40, at=clock())        # this version and older ones of the layer
    unwritten.settled("embed", 40)                      # failed or lost: it will never commit
    unwritten.oldest(now=clock())                       # -> OldestUnwritten | None
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

VersionKey = tuple[str, int]  # layer, step


@dataclass(frozen=True, kw_only=True)
class OldestUnwritten:
    """The oldest version handed over and not settled, and how long storage has left it unanswered."""

    layer: str
    step: int
    waited_s: float
    """Seconds since it was handed over, or since storage last committed a version if that is later."""

    def to_json(self) -> dict[str, object]:
        return {"layer": self.layer, "step": self.step, "waited_s": self.waited_s}


@dataclass
class UnwrittenVersions:
    _handed: dict[VersionKey, float] = field(default_factory=dict)
    """Per version handed over and not settled, when (the supervisor's clock) rank 0 said so."""
    _settled_first: set[VersionKey] = field(default_factory=set)
    """Versions that failed or were lost before rank 0's word of their hand-over came in (its
    progress and a writer's report travel apart): not to be counted unwritten when it does."""
    last_commit_at: float | None = None
    """When storage last committed a version (whole or partial); ``None``: not yet."""

    def handed_over(self, layers: Iterable[str], *, step: int, at: float, newest: Mapping[str, int | None]) -> None:
        """Rank 0 handed ``layers`` over as versions of ``step`` (``newest``: each layer's newest
        committed step; a version already committed or superseded is not unwritten)."""
        for layer in layers:
            key = (layer, step)
            committed = newest.get(layer)
            if key in self._settled_first:
                self._settled_first.discard(key)
            elif committed is None or committed < step:
                self._handed.setdefault(key, at)

    def committed(self, layer: str, step: int, *, at: float, partial: bool = False) -> None:
        """A version of ``layer`` at ``step`` committed: older ones of the layer never will be
        (the commit path abandons them). A partial version settles nothing, but storage answered."""
        self.last_commit_at = at
        if partial:
            return
        for key in [k for k in self._handed if k[0] == layer and k[1] <= step]:
            del self._handed[key]

    def settled(self, layer: str, step: int) -> None:
        """The version of ``layer`` at ``step`` failed or was lost: it will never commit."""
        if self._handed.pop((layer, step), None) is None:
            self._settled_first.add((layer, step))

    def clear(self) -> None:
        """A worker group was lost and its writers drained: what it handed over is committed,
        failed or lost by now, and nothing of it is waited for any more."""
        if self._handed:
            logger.info("%d unwritten version(s) of the lost group written off", len(self._handed))
        self._handed.clear()
        self._settled_first.clear()

    def oldest(self, *, now: float) -> OldestUnwritten | None:
        """The oldest version not settled, or ``None`` when storage owes nothing."""
        if not self._handed:
            return None
        (layer, step), at = min(self._handed.items(), key=lambda item: (item[1], item[0][1]))
        since = max(at, self.last_commit_at) if self.last_commit_at is not None else at
        return OldestUnwritten(layer=layer, step=step, waited_s=max(0.0, now - since))

    def __len__(self) -> int:
        return len(self._handed)
