"""One version of a layer in flight at a time: the gate between a policy's decisions and the writers.

Every rank snapshots the layers a decision names and hands its shard to a writer; a version
commits once every rank's shard is written. If a new snapshot of a layer could replace an older
one still waiting in a writer's queue, ranks whose writers run at different paces would each keep
a *different* step of the layer, and no version of it would ever be whole (seen under load: two
ranks alternating steps, nothing committed for a whole run). So no writer drops a shard of
another step; instead the gate admits a layer into a decision only while fewer than
``max_in_flight`` of its versions are in flight (decided, not yet *settled*: committed, or known
lost); a layer the policy asks for while it is full is deferred, keeping its reason, and joins the
first decision after one of its versions settles. Memory stays bounded by ``max_in_flight``
pending versions a layer, every version handed over is written by every rank, and when storage is slower than the policy the save
rate of each layer falls to what storage sustains (the staleness it costs shows in the metrics).

Pure bookkeeping, no I/O: the policy service applies it to every decision, identically on every
replica, and the runtime reports settled versions back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from layercheck.policies.decision import PersistDecision, Reason

logger = logging.getLogger(__name__)


@dataclass
class PersistGate:
    max_in_flight: int = 1
    """Versions of one layer that may be in flight at once (decided, not yet settled)."""
    in_flight: dict[str, list[int]] = field(default_factory=dict)
    """Per layer, the steps of the decisions whose versions have not settled yet, oldest first."""
    deferred: dict[str, Reason] = field(default_factory=dict)
    """Layers the policy asked for while they were full, with the reason it gave."""
    deferrals: int = 0
    """How many times a layer was held back (a sign that storage is slower than the policy)."""

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight: must be >= 1, got {self.max_in_flight}")

    def full(self, layer: str) -> bool:
        return len(self.in_flight.get(layer, ())) >= self.max_in_flight

    def admit(self, decision: PersistDecision) -> PersistDecision:
        """The decision with every layer that has ``max_in_flight`` versions in flight held back,
        and every held-back layer that has room again added (model order as in ``decision``, then
        the held-back ones)."""
        if not decision.layers and not self.deferred:
            return decision  # (most steps)
        admitted: dict[str, Reason] = {}
        for name, reason in decision.layers:
            if self.full(name):
                if name not in self.deferred:
                    self.deferrals += 1
                    logger.info(
                        "step %d: %s deferred: its version(s) of step(s) %s have not committed yet",
                        decision.step,
                        name,
                        self.in_flight[name],
                    )
                self.deferred[name] = reason
            else:
                admitted[name] = reason
        for name in [n for n in self.deferred if not self.full(n) and n not in admitted]:
            admitted[name] = self.deferred.pop(name)
        for name in admitted:
            self.deferred.pop(name, None)
            self.in_flight.setdefault(name, []).append(decision.step)
        return PersistDecision.of(decision.step, admitted)

    def settled(self, layer: str, version_step: int) -> None:
        """The version of ``layer`` taken at ``version_step`` committed, or will never commit
        (a write failed, the version was abandoned): versions decided at or before that step are
        no longer in flight (an older one still unwritten can never commit once a newer is in)."""
        steps = [s for s in self.in_flight.get(layer, ()) if s > version_step]
        if steps:
            self.in_flight[layer] = steps
        else:
            self.in_flight.pop(layer, None)

    def reset(self) -> None:
        """A new worker group: nothing of the lost one is in flight any more."""
        self.in_flight.clear()
        self.deferred.clear()
