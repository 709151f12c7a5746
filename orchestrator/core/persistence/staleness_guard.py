"""The staleness bound, watched: when a layer goes unsaved past the policy's ``smax`` plus the
pipeline lag, the run's promise is broken and the operator must hear it, whatever the cause:
storage failures (a full or read-only disk, an object-store outage, a dead writer), storage that
does not answer (an endpoint that accepts connections and never replies, a hung mount: the oldest
version handed to the writers has waited past ``persistence.hung_write_s`` with nothing committed
meanwhile), or storage that is merely slower than the policy (writes complete, late). The first
two are a breach: the guard says which cause it saw and what the config says to do; the supervisor
carries it out (stop the workers after the current step, or keep going with the error logged)
and the metrics export it. The third is lag, a warning that never stops the run. Policies without
a staleness budget (``interval``, ``never``) are never breached.

The verdict follows the facts: failures known only after the bound was first passed (a lag)
make it a breach at the next check, and so do those that arrive after the last step, in the
end-of-run drain (:meth:`StalenessGuard.check` with ``at_end``); a breach's failure counts are
the run's latest, so the summary's breach row and its failure counts never disagree.

API::

    guard = StalenessGuard(limits=StalenessLimits.of(policy_config, on_breach="stop", hung_write_s=96.0))
    facts = StorageFacts(write_failures=3, commit_failures=0, unwritten=commits.unwritten.oldest(now=t_now))
    breach = guard.check(step=t, last_steps={"embed": 40, ...}, facts=facts)  # None, or once a value
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from layercheck.orchestrator.core.persistence.unwritten_versions import OldestUnwritten
from layercheck.orchestrator.store.s3_limits import worst_request_s
from layercheck.policies.configs import DriftOptimalConfig, LayerCheckConfig, PolicyConfig, StaggeredConfig

logger = logging.getLogger(__name__)

#: Steps between a decision and the state it persists (``layercheck.workers.loop.DECISION_LAG``), allowed on top of ``smax``.
PIPELINE_LAG = 1
BREACH_ACTIONS = ("stop", "warn")
#: Requests one version costs storage at most on an object store: its shard's directory marker,
#: upload and completion, and its commit's manifest entry.
HUNG_WRITE_REQUESTS = 4
#: ``persistence.hung_write_s`` by default: that many requests, each unanswered for as long as
#: LayerCheck's S3 client allows before it fails the write (3 attempts × (3 s connect + 5 s
#: request) = 24 s), so 96 s. Storage silent for longer than any write can take to fail does not
#: answer; a slow store commits something well within it.
DEFAULT_HUNG_WRITE_S = HUNG_WRITE_REQUESTS * worst_request_s()


@dataclass(frozen=True, kw_only=True)
class StalenessLimits:
    smax: int | None
    """The policy's staleness budget; ``None``: the policy has none (nothing to breach)."""
    warmup_steps: int = 0
    """Before the base checkpoint a layer has no version yet: its staleness counts from here."""
    on_breach: str = "stop"
    hung_write_s: float = DEFAULT_HUNG_WRITE_S
    """Past the bound, storage that has left a version unanswered this long does not answer: a breach."""

    def __post_init__(self) -> None:
        if self.on_breach not in BREACH_ACTIONS:
            raise ValueError(f"on_breach: must be one of {BREACH_ACTIONS}, got {self.on_breach!r}")
        if not self.hung_write_s > 0:
            raise ValueError(f"hung_write_s: must be > 0, got {self.hung_write_s!r}")

    @classmethod
    def of(cls, policy: PolicyConfig, *, on_breach: str, hung_write_s: float = DEFAULT_HUNG_WRITE_S) -> StalenessLimits:
        """The limits of a policy config (any config with ``smax``; others have none)."""
        bounded = policy if isinstance(policy, (LayerCheckConfig, DriftOptimalConfig, StaggeredConfig)) else None
        return cls(
            smax=int(bounded.smax) if bounded is not None else None,
            warmup_steps=int(bounded.warmup_steps) if bounded is not None else 0,
            on_breach=on_breach,
            hung_write_s=hung_write_s,
        )

    @property
    def limit(self) -> int | None:
        return None if self.smax is None else self.smax + PIPELINE_LAG


@dataclass(frozen=True, kw_only=True)
class StorageFacts:
    """What storage has done so far, as the run's own counts say (the summary shows the same)."""

    write_failures: int = 0
    commit_failures: int = 0
    """Commit tries that failed (the retried ones and the last, lost, one)."""
    writers_replaced: int = 0
    """Persistence writers that died and were replaced: not storage's fault, and nothing lost by
    it (their snapshots went to the replacement), but their rewrites add to the lag."""
    unwritten: OldestUnwritten | None = None
    """The oldest version handed over and not settled, while there is one."""

    @property
    def failures(self) -> int:
        return self.write_failures + self.commit_failures


@dataclass(frozen=True, kw_only=True)
class StalenessBreach:
    """Layer ``layer`` was ``staleness`` steps stale at ``step``, past ``limit``: by storage
    failures (``write_failures`` + ``commit_failures``, the latest counts), by storage that does
    not answer (``unwritten``, as seen then), or — ``action`` ``"lag"`` — by neither."""

    step: int
    layer: str
    staleness: int
    limit: int
    action: str
    """``stop`` or ``warn`` (``persistence.on_staleness_breach``); ``lag``: passed, not broken."""
    write_failures: int = 0
    commit_failures: int = 0
    writers_replaced: int = 0
    unwritten: OldestUnwritten | None = None
    """The version storage left unanswered past ``hung_write_s``, if that is a cause (else ``None``)."""
    hung_write_s: float = DEFAULT_HUNG_WRITE_S
    at_end: bool = False
    """Found after the last step (in the end-of-run drain), not while the run trained."""

    @property
    def storage_failures(self) -> int:
        return self.write_failures + self.commit_failures

    @property
    def culprit(self) -> str:
        """What broke the bound, in a few words (the stop reason's)."""
        causes = ["storage failures"] if self.storage_failures else []
        causes += ["storage that does not answer"] if self.unwritten is not None else []
        return " and ".join(causes) or "storage that does not keep up"

    @property
    def cause(self) -> str:
        causes = []
        if self.storage_failures:
            causes.append(
                f"storage failures ({self.write_failures} failed write(s), {self.commit_failures} failed commit(s))"
            )
        if self.unwritten is not None:
            u = self.unwritten
            causes.append(
                f"storage that does not answer (the oldest unwritten version, {u.layer} step {u.step}, waited "
                f"{u.waited_s:.0f} s with nothing committed, past persistence.hung_write_s = {self.hung_write_s:g} s)"
            )
        cause = " and ".join(causes) or (
            "storage that does not keep up (no write failed, and no version waited past "
            f"persistence.hung_write_s = {self.hung_write_s:g} s unanswered: it is slow)"
        )
        if self.writers_replaced:
            cause += (
                f", after {self.writers_replaced} persistence writer(s) died and were replaced (what each "
                "held was handed to its replacement and written again)"
            )
        return cause

    @property
    def message(self) -> str:
        if self.action == "lag":
            then = (
                "found after the last step; check the storage"
                if self.at_end
                else "training goes on (storage that writes, however slowly, is no breach); check the storage"
            )
        elif self.at_end:
            then = (
                "found after the last step, in the end-of-run drain: the store may not hold the final state; "
                "fix the storage and resume"
            )
        elif self.action == "stop":
            then = (
                'the run stops after this step (persistence.on_staleness_breach = "stop"); fix the storage and resume'
            )
        else:
            then = 'training goes on unprotected (persistence.on_staleness_breach = "warn")'
        return (
            f"staleness bound {'passed' if self.action == 'lag' else 'broken'} by {self.cause}: {self.layer} is "
            f"{self.staleness} steps stale at step "
            f"{self.step} (smax + lag = {self.limit}); {then}"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "step": self.step,
            "layer": self.layer,
            "staleness": self.staleness,
            "limit": self.limit,
            "action": self.action,
            "storage_failures": self.storage_failures,
            "write_failures": self.write_failures,
            "commit_failures": self.commit_failures,
            "writers_replaced": self.writers_replaced,
            "unwritten": self.unwritten.to_json() if self.unwritten is not None else None,
            "hung_write_s": self.hung_write_s,
            "at_end": self.at_end,
            "message": self.message,
        }


@dataclass
class StalenessGuard:
    limits: StalenessLimits
    breach: StalenessBreach | None = None
    """The run's breach (reported once; its failure counts kept up to date; the metric stays up)."""
    lag: StalenessBreach | None = None
    """The first time the bound was passed by storage that neither failed nor stopped answering:
    reported once, as a warning; it never stops the run (failures known later make it a breach)."""

    def check(
        self, *, step: int, last_steps: Mapping[str, int | None], facts: StorageFacts, at_end: bool = False
    ) -> StalenessBreach | None:
        """The breach, the first time ``step`` (``at_end``: the last step, after the final drain)
        finds one; else ``None``. A breach is a layer past the bound while storage has failed, or
        has left a version unanswered past ``hung_write_s``; or a lag recorded earlier once a
        failure is known. A pass of the bound by neither is kept in :attr:`lag` (a writer that died
        and was replaced is no storage failure and loses nothing, so it only adds to lag). A breach
        already found takes the latest failure counts, so what it says agrees with the run's."""
        limit = self.limits.limit
        if limit is None:
            return None
        if self.breach is not None:
            self.breach = dataclasses.replace(
                self.breach,
                write_failures=facts.write_failures,
                commit_failures=facts.commit_failures,
                writers_replaced=facts.writers_replaced,
            )
            return None
        worst = self._worst(step, last_steps, limit)
        unwritten = facts.unwritten
        hung = unwritten if unwritten is not None and unwritten.waited_s > self.limits.hung_write_s else None
        if worst is not None and (facts.failures or hung is not None):
            return self._broken(step, worst, limit, facts, hung, at_end=at_end)
        if self.lag is not None and facts.failures:  # passed before the failures were known (or came)
            return self._broken(self.lag.step, (self.lag.staleness, self.lag.layer), limit, facts, None, at_end=at_end)
        if worst is not None and self.lag is None:
            self.lag = self._record(step, worst, limit, facts, None, action="lag", at_end=at_end)
            logger.warning("%s", self.lag.message)
        return None

    def _worst(self, step: int, last_steps: Mapping[str, int | None], limit: int) -> tuple[int, str] | None:
        """The stalest layer past ``limit`` at ``step`` (its staleness and name), if any."""
        worst: tuple[int, str] | None = None
        for layer, last in last_steps.items():
            staleness = step - (last if last is not None else self.limits.warmup_steps)
            if staleness > limit and (worst is None or staleness > worst[0]):
                worst = (staleness, layer)
        return worst

    def _broken(
        self,
        step: int,
        worst: tuple[int, str],
        limit: int,
        facts: StorageFacts,
        hung: OldestUnwritten | None,
        *,
        at_end: bool,
    ) -> StalenessBreach:
        self.breach = self._record(step, worst, limit, facts, hung, action=self.limits.on_breach, at_end=at_end)
        logger.error("%s", self.breach.message)
        return self.breach

    def _record(
        self,
        step: int,
        worst: tuple[int, str],
        limit: int,
        facts: StorageFacts,
        hung: OldestUnwritten | None,
        *,
        action: str,
        at_end: bool,
    ) -> StalenessBreach:
        return StalenessBreach(
            step=step,
            layer=worst[1],
            staleness=worst[0],
            limit=limit,
            action=action,
            write_failures=facts.write_failures,
            commit_failures=facts.commit_failures,
            writers_replaced=facts.writers_replaced,
            unwritten=hung,
            hung_write_s=self.limits.hung_write_s,
            at_end=at_end,
        )
