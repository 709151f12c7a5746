"""The run's central view without Ray: progress, time accounting and write statistics, and the
status (``run_status.RunStatus``) the driver's progress line, the summary and the metrics show."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from layercheck.orchestrator.core.accounting import FallbackReason, RankStart, Recovery, RunAccount
from layercheck.orchestrator.core.persistence.commit_path import CommitPath
from layercheck.orchestrator.core.persistence.staleness_guard import StorageFacts
from layercheck.orchestrator.core.recovery.events import RecordRecovery
from layercheck.orchestrator.core.run_status import LayerFigures, RunStatus
from layercheck.workers.progress import StepProgress


@dataclass
class Progress:
    step: int = 0
    loss: float = float("nan")
    lr: float = 0.0
    step_s: float = 0.0


@dataclass(kw_only=True)
class RunView:
    run_id: str
    layer_numel: Mapping[str, int]
    account: RunAccount
    progress: Progress = field(default_factory=Progress)
    write_latencies: list[float] = field(default_factory=list)
    write_failures: int = 0
    writers_replaced: int = 0
    """Writer actors found dead and replaced (each one's versions in flight counted lost)."""
    breach: dict[str, object] | None = None
    """The staleness breach (``StalenessBreach.to_json``), if storage failures or storage that
    does not answer broke ``smax``."""
    staleness_lag: dict[str, object] | None = None
    """The first pass of ``smax`` by storage that neither failed nor stopped answering (slow), if any."""
    stop_reason: str | None = None
    """Why the run was asked to stop early (Ctrl-C, a breach), if it was."""
    in_place: bool = False
    """The run asked for in-place recovery (``cluster.in_place``)."""
    refused: FallbackReason | None = None
    """The first rank's word on leaving in-place recovery, for the next recovery (``None``: none)."""
    in_place_off: FallbackReason | None = None
    """The failed recovery in a survivor's own process that turned in-place recovery off for the
    rest of the run (``None``: on): from then on the survivors of a loss leave and are replaced."""

    def step_done(self, progress: StepProgress, *, now: float) -> None:
        """Rank 0 finished a step."""
        recovering = self._open_recovery()
        self.account.step_done(
            progress.step,
            progress.compute_s,
            progress.stall_s,
            now,
            loss=progress.loss,
            lr=progress.lr,
            coordination_s=progress.coordination_s,
        )
        if progress.probe is not None:
            self.account.probe.add(progress.probe)
        if recovering is not None and recovering.failure_to_step_s is not None:
            self.refused = None  # said of the recovery just done, and told there
        self.progress = Progress(step=progress.step, loss=progress.loss, lr=progress.lr, step_s=progress.compute_s)

    def record_recovery(self, action: RecordRecovery) -> None:
        recovery = self.account.failed(
            t_fail=action.t_fail,
            resumed_at=action.resumed_at,
            now=action.detected_at,
            lost_group=action.lost_group and action.groups_lost > 0,  # a grow restarts, it is no failure
        )
        self.account.failures += max(0, action.groups_lost - 1)  # groups lost again during the recovery
        recovery.world_size = action.world_size
        recovery.grown_from = action.grown_from
        recovery.kind = (
            "grow" if action.grown_from else "failure" if action.lost_group or action.attempt > 1 else "resume"
        )
        recovery.attempt = action.attempt
        recovery.plan_s, recovery.drain_s = action.plan_s, action.drain_s
        recovery.max_staleness = action.max_staleness
        recovery.weighted_staleness = action.weighted_staleness
        recovery.sources = {layer: [s.to_json() for s in sources] for layer, sources in action.sources.items()}
        recovery.in_place = self.in_place
        recovery.refused, self.refused = self.refused, None

    def in_place_refused(self, refused: FallbackReason) -> None:
        """A rank of an in-place run raised out of its train function (Ray Train replaces it, or
        restarts the group if no rank is left): the next recovery says why, and so does a recovery
        still under way (the rank left it). A failed recovery turns in-place recovery off."""
        self.refused = self.refused or refused
        if refused.reason == "recovery_failed" and self.in_place_off is None:
            self.in_place_off = refused
        recovering = self._open_recovery()
        if recovering is not None and recovering.refused is None:
            recovering.refused = refused

    def _open_recovery(self) -> Recovery | None:
        """The latest recovery while its group has not completed a step yet."""
        last = self.account.recoveries[-1] if self.account.recoveries else None
        return last if last is not None and last.failure_to_step_s is None else None

    def loaded(
        self,
        load_s: float,
        sources: Mapping[str, float] | None = None,
        *,
        start: RankStart | None = None,
        now: float = 0.0,
    ) -> None:
        """A rank loaded the composite; recovery load time is the slowest rank's, and where its
        shard files came from (memory on its node, on another node, storage) adds up over ranks.
        ``start``: how the rank got there (``Recovery.rank_ready``)."""
        if self.account.recoveries:
            last = self.account.recoveries[-1]
            last.load_s = max(last.load_s, load_s)
            last.add_sources(sources or {})
            last.rank_ready(start or RankStart(), now=now, load_s=load_s)

    def storage_facts(self, commits: CommitPath, *, now: float) -> StorageFacts:
        """What storage has done so far: failed writes and failed commit tries (not lost worker
        groups, nor writers that died: their snapshots are handed to a replacement, nothing is
        lost), and the oldest version it has left unanswered, as of ``now``."""
        return StorageFacts(
            write_failures=self.write_failures,
            commit_failures=commits.commit_failures,
            writers_replaced=self.writers_replaced,
            unwritten=commits.unwritten.oldest(now=now),
        )

    def status(
        self,
        *,
        state: str,
        attempt: int,
        commits: CommitPath,
        metrics_url: str | None,
        now: float,
        world_size: int,
        grown_from: int,
        memory_period: dict[str, object] | None,
    ) -> RunStatus:
        step = self.progress.step
        layers = commits.stats
        staleness = {name: (step - s.last_step if s.last_step is not None else None) for name, s in layers.items()}
        known = {n: v for n, v in staleness.items() if v is not None}
        total = sum(self.layer_numel[n] for n in known)
        return RunStatus(
            run_id=self.run_id,
            metrics_url=metrics_url,
            state=state,
            attempt=attempt,
            step=step,
            loss=self.progress.loss,
            lr=self.progress.lr,
            step_s=self.progress.step_s,
            staleness=staleness,
            max_staleness=max(known.values()) if known else None,
            weighted_staleness=(sum(self.layer_numel[n] * v for n, v in known.items()) / total)
            if known and len(known) == len(staleness)
            else None,
            layers={
                name: LayerFigures(versions=s.versions, bytes=s.bytes, last_step=s.last_step)
                for name, s in layers.items()
            },
            bytes_committed=sum(s.bytes for s in layers.values()),
            versions_committed=sum(s.versions for s in layers.values()),
            partial_bytes_committed=sum(s.partial_bytes for s in layers.values()),
            partial_versions_committed=sum(s.partial_versions for s in layers.values()),
            abandoned_versions=commits.tracker.abandoned,
            lost_versions=commits.lost_versions,
            lost=list(commits.lost),
            commit_retries=commits.commit_retries,
            write_failures=self.write_failures,
            writers_replaced=self.writers_replaced,
            staleness_breach=self.breach,
            staleness_lag=self.staleness_lag,
            stop_reason=self.stop_reason,
            write_latencies=list(self.write_latencies),
            account=self.account.summary(now),
            world_size=world_size,
            grown_from=grown_from,
            memory_period=memory_period,
        )
