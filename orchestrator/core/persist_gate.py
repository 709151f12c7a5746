"""One version of a layer in flight at a time: the gate between a policy's decisions and the writers.

Every rank snapshots the layers a decision names and hands its shard to a writer; a version
commits once every rank's shard is written. If a new snapshot of a layer could replace an older
one still waiting in a writer's queue, ranks whose writers run at different paces would each keep
a *different* step of the layer, and no version of it would ever be whole (seen under load: two
ranks alternating steps, nothing committed for a whole run). So the gate admits a layer into a
decision only when its previous version has *settled* (committed, or known lost); a layer the
policy asks for while its previous version is in flight is deferred, keeping its reason, and
joins the first decision after it settles. Memory stays bounded by one pending version a layer,
no writer ever needs to drop a shard, and when storage is slower than the policy the save
rate of each layer falls to what storage sustains (the staleness it costs shows in the metrics).

Pure bookkeeping, no I/O: the policy service applies it to every decision, identically on every
replica, and the runtime reports settled versions back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from policies.decision import PersistDecision, Reason

logger = logging.getLogger(__name__)


@dataclass
class PersistGate:
    in_flight: dict[str, int] = field(default_factory=dict)
    """Per layer, the step of the decision whose version has not settled yet."""
    deferred: dict[str, Reason] = field(default_factory=dict)
    """Layers the policy asked for while they were in flight, with the reason it gave."""
    deferrals: int = 0
    """How many times a layer was held back (a sign that storage is slower than the policy)."""

    def admit(self, decision: PersistDecision) -> PersistDecision:
        """The decision with every layer in flight held back, and every held-back layer that has
        since settled added (model order as in ``decision``, then the held-back ones)."""
        admitted: dict[str, Reason] = {}
        for name, reason in decision.layers:
            if name in self.in_flight:
                if name not in self.deferred:
                    self.deferrals += 1
                    logger.info("step %d: %s deferred: its version of step %d has not committed yet",
                                decision.step, name, self.in_flight[name])
                self.deferred[name] = reason
            else:
                admitted[name] = reason
        for name in [n for n in self.deferred if n not in self.in_flight and n not in admitted]:
            admitted[name] = self.deferred.pop(name)
        for name in admitted:
            self.deferred.pop(name, None)
            self.in_flight[name] = decision.step
        return PersistDecision.of(decision.step, admitted)

    def settled(self, layer: str, version_step: int) -> None:
        """The version of ``layer`` taken at ``version_step`` committed, or will never commit
        (a write failed, the version was abandoned): a version decided at or before that step is
        no longer in flight."""
        decided = self.in_flight.get(layer)
        if decided is not None and decided <= version_step:
            del self.in_flight[layer]

    def reset(self) -> None:
        """A new worker group: nothing of the lost one is in flight any more."""
        self.in_flight.clear()
        self.deferred.clear()
