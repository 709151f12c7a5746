"""The staleness bound, watched: when a layer goes unsaved past the policy's ``smax`` plus the
pipeline lag, the run's promise is broken and the operator must hear it, whatever the cause:
storage failures (a full or read-only disk, an object-store outage, a dead writer), or storage
that fails nothing and never finishes (an endpoint that accepts connections and never answers,
writes far slower than the policy). The guard decides *that* it is broken (once per run), says
which cause it saw, and what the config says to do; the supervisor carries it out (stop the
workers after the current step, or keep going with the error logged) and the metrics export it.
Policies without a staleness budget (``interval``, ``never``) are never breached.

API::

    guard = StalenessGuard(limits=StalenessLimits.of(policy_config, on_breach="stop"))
    breach = guard.check(step=t, last_steps={"embed": 40, ...}, storage_failures=3)  # None, or once a value
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from layercheck.policies.configs import PolicyConfig

logger = logging.getLogger(__name__)

#: Steps between a decision and the state it persists (``layercheck.workers.loop.DECISION_LAG``), allowed on top of ``smax``.
PIPELINE_LAG = 1
BREACH_ACTIONS = ("stop", "warn")


@dataclass(frozen=True, kw_only=True)
class StalenessLimits:
    smax: int | None
    """The policy's staleness budget; ``None``: the policy has none (nothing to breach)."""
    warmup_steps: int = 0
    """Before the base checkpoint a layer has no version yet: its staleness counts from here."""
    on_breach: str = "stop"

    def __post_init__(self) -> None:
        if self.on_breach not in BREACH_ACTIONS:
            raise ValueError(f"on_breach: must be one of {BREACH_ACTIONS}, got {self.on_breach!r}")

    @classmethod
    def of(cls, policy: PolicyConfig, *, on_breach: str) -> StalenessLimits:
        """The limits of a policy config (any config with ``smax``; others have none)."""
        smax = getattr(policy, "smax", None)
        return cls(
            smax=int(smax) if smax is not None else None,
            warmup_steps=int(getattr(policy, "warmup_steps", 0) or 0),
            on_breach=on_breach,
        )

    @property
    def limit(self) -> int | None:
        return None if self.smax is None else self.smax + PIPELINE_LAG


@dataclass(frozen=True, kw_only=True)
class StalenessBreach:
    """Layer ``layer`` was ``staleness`` steps stale at ``step``, past ``limit`` (after
    ``storage_failures`` failed writes or lost versions; 0: storage that is slow or not answering)."""

    step: int
    layer: str
    staleness: int
    limit: int
    action: str
    storage_failures: int
    writers_replaced: int = 0
    """Persistence writers that died and were replaced so far: not storage's fault, and nothing
    lost by it (their snapshots went to the replacement), but their rewrites add to the lag."""

    @property
    def message(self) -> str:
        then = (
            'the run stops after this step (persistence.on_staleness_breach = "stop"); fix the storage and resume'
            if self.action == "stop"
            else 'training goes on unprotected (persistence.on_staleness_breach = "warn")'
            if self.storage_failures
            else "training goes on (only storage failures stop a run); check the storage"
        )
        cause = (
            f"storage failures ({self.storage_failures} failed write(s) or commit(s))"
            if self.storage_failures
            else "storage that does not keep up (no write failed: it is slow, or hangs)"
        )
        if self.writers_replaced:
            cause += (
                f", after {self.writers_replaced} persistence writer(s) died and were replaced (what each "
                "held was handed to its replacement and written again)"
            )
        return (
            f"staleness bound broken by {cause}: {self.layer} is {self.staleness} steps stale at step "
            f"{self.step} (smax + lag = {self.limit}); {then}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "layer": self.layer,
            "staleness": self.staleness,
            "limit": self.limit,
            "action": self.action,
            "storage_failures": self.storage_failures,
            "writers_replaced": self.writers_replaced,
            "message": self.message,
        }


@dataclass
class StalenessGuard:
    limits: StalenessLimits
    breach: StalenessBreach | None = None
    """The first breach of the run by storage failures (it is reported once; the metric stays up)."""
    lag: StalenessBreach | None = None
    """The first time the bound was passed while no write had failed (storage that is slow or
    hangs): reported once, as a warning; it never stops the run."""

    def check(
        self, *, step: int, last_steps: Mapping[str, int | None], storage_failures: int, writers_replaced: int = 0
    ) -> StalenessBreach | None:
        """The breach by storage failures, the first time ``step`` finds one; else ``None`` (a
        first pass of the bound without failures is kept in :attr:`lag` instead: a writer that
        died and was replaced is no storage failure and loses nothing, so it only adds to lag)."""
        limit = self.limits.limit
        if self.breach is not None or limit is None:
            return None
        worst: tuple[int, str] | None = None
        for layer, last in last_steps.items():
            staleness = step - (last if last is not None else self.limits.warmup_steps)
            if staleness > limit and (worst is None or staleness > worst[0]):
                worst = (staleness, layer)
        if worst is None:
            return None
        if storage_failures == 0:
            if self.lag is None:
                self.lag = StalenessBreach(
                    step=step,
                    layer=worst[1],
                    staleness=worst[0],
                    limit=limit,
                    action="warn",
                    storage_failures=0,
                    writers_replaced=writers_replaced,
                )
                logger.warning("%s", self.lag.message)
            return None
        self.breach = StalenessBreach(
            step=step,
            layer=worst[1],
            staleness=worst[0],
            limit=limit,
            action=self.limits.on_breach,
            storage_failures=storage_failures,
            writers_replaced=writers_replaced,
        )
        logger.error("%s", self.breach.message)
        return self.breach
