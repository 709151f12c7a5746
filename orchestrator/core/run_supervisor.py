"""The run's supervision, carried out: feeds the Ray-free cores (:class:`RecoveryMachine`,
:class:`CommitPath`, :class:`RunView`) their events and executes the actions they return,
against a store, a policy and a set of writers behind two small protocols
(:mod:`~layercheck.orchestrator.core.supervision_ports`). Any runtime hosts it: the Ray
``SupervisorActor`` wraps one (with Ray-backed ports); an in-process torch.distributed runtime
can call it directly (``LocalPolicy`` over its :class:`PolicyService`).

One file because it is one class around one lock (below): its entry points feed the cores and its
``_execute_*`` methods carry out what they return, under the same lock discipline; its ports and
the step a capture moves the recovery to live apart (``supervision_ports.py``,
``recovery/capture_window.py``).

API::

    run = RunSupervisor(run_id=..., store=LayerStore.open(uri), layer_numel=...,
                        policy=LocalPolicy(service), writers=my_writers, resume=False)
    resume = run.join(rank, world_size, worker_id)   # -> ResumeInfo, once the group's recovery is done
    run.shard_written(receipt, write_s)               # commits (retrying) when a version is whole
    run.write_failed(layer, step); run.version_unusable(vid, why); run.loaded(load_s)
    run.writer_died(lost=[(layer, step), ...], reason=..., replaced=True)  # lost versions free the gate
    run.request_stop(reason)                          # Ctrl-C: ranks stop after the same step
    run.lease_renewed(valid_until)                    # the driver's renewal reached the store
    run.progress(StepProgress(step=..., loss=..., lr=..., compute_s=..., stall_s=...))
                                                      # with memory_period=PeriodTimer(...) ("auto"):
                                                      # its memory_s choose the period the decisions carry
    run.final_drain(drain_s)                          # the end: bounded; what is left is lost
    run.steps_ended()                                 # the staleness verdict on the final counts
    run.finish(ok, reason); run.status(metrics_url=None) -> RunStatus; run.state_name

Thread-safe by construction: one lock guards the cores and is held only while they decide —
never while an action runs — so writers may commit through :meth:`shard_written` while a
recovery drains them, and joins of one group wait on a condition, not on each other's work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from layercheck.orchestrator.core.accounting import FallbackReason, RankStart, RunAccount
from layercheck.orchestrator.core.memory.auto_period import PeriodTimer
from layercheck.orchestrator.core.memory.versions import MemoryVersions
from layercheck.orchestrator.core.persistence.commit_path import (
    CommitFailed,
    CommitPath,
    CommitSucceeded,
    CommitVersion,
    HandedOver,
    RunClosed,
    ShardFailed,
    ShardWritten,
    VersionsLost,
)
from layercheck.orchestrator.core.persistence.staleness_guard import StalenessBreach, StalenessGuard, StalenessLimits
from layercheck.orchestrator.core.recovery.capture_window import recovery_step
from layercheck.orchestrator.core.recovery.config import SupervisionConfig
from layercheck.orchestrator.core.recovery.events import (
    AbandonIncomplete,
    Action,
    DismissJoins,
    DrainWriters,
    Event,
    NoComposite,
    PlanComposite,
    PublishResume,
    RankJoined,
    RebasePolicy,
    RecordRecovery,
    ReplaceWriters,
    ResumeInfo,
    RunEnded,
    VersionUnusable,
    WritersDrained,
)
from layercheck.orchestrator.core.recovery.known_versions import KnownVersions
from layercheck.orchestrator.core.recovery.plan_composite import plan_composite
from layercheck.orchestrator.core.recovery.state_machine import Recovering, RecoveryMachine, Running
from layercheck.orchestrator.core.run_status import RunStatus
from layercheck.orchestrator.core.run_view import RunView
from layercheck.orchestrator.core.supervision_ports import (
    HeldPaths,
    KnowsUnfinished,
    PolicyPort,
    SetsMemoryPeriod,
    WritersPort,
)
from layercheck.orchestrator.store.errors import LeaseLapsedError, LeaseLostError, StoreUnavailableError
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.lease import LEASE_LOST
from layercheck.orchestrator.store.lease_term import LEASE_LAPSED
from layercheck.orchestrator.store.manifest import MEMORY_ORIGIN, ShardReceipt
from layercheck.workers.progress import StepProgress

logger = logging.getLogger(__name__)


def _stop_reason(breach: StalenessBreach) -> str:
    when = " after the last step" if breach.at_end else ""
    return (
        f"{breach.culprit} broke the staleness bound{when} ({breach.layer}: {breach.staleness} "
        f"steps stale > {breach.limit})"
    )


Step = Action | CommitVersion
"""What the cores ask the supervisor to carry out: the recovery machine's actions and the commit path's commits."""


class JoinDismissed(RuntimeError):
    """A rank's group was replaced by a newer one, or its recovery failed, before it was answered."""


class RunSupervisor:
    def __init__(
        self,
        *,
        run_id: str,
        store: LayerStore,
        layer_numel: Mapping[str, int],
        policy: PolicyPort,
        writers: WritersPort,
        config: SupervisionConfig | None = None,
        resume: bool = False,
        limits: StalenessLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        in_place: bool = False,
        memory_period: PeriodTimer | None = None,
    ) -> None:
        """``memory_period``: the run's memory-version period and, under ``"auto"``, the timer
        that chooses it from rank 0's progress (``core/memory/auto_period.py``); ``None``: none
        to tell (the summary has the config's)."""
        config = config or SupervisionConfig()
        self.store = store
        self.layer_numel = dict(layer_numel)
        self.policy = policy
        self.writers = writers
        self.clock = clock
        self.sleep = sleep
        self._lock = threading.Lock()  # the cores and the answers; held only while they decide
        self._answered = threading.Condition(self._lock)
        self.supervision = RecoveryMachine(config=config, resume=resume)
        self.commits = CommitPath(layers=list(layer_numel), config=config, clock=clock)
        self.view = RunView(
            run_id=run_id, layer_numel=self.layer_numel, account=RunAccount(started=clock()), in_place=in_place
        )
        self.guard = StalenessGuard(limits=limits or StalenessLimits(smax=None))
        self._published: dict[int, ResumeInfo] = {}
        self._dismissed: dict[int, str] = {}
        self.lease_lost = ""
        """Why this run stopped committing (its store's lease is another run's); "" while it owns it."""
        self.not_draining = threading.Event()
        """Clear while a recovery drains the writers (a shell hands out writers only when set)."""
        self.not_draining.set()
        self.memory_versions = MemoryVersions()
        """The writers' memory versions (``persistence.memory_period``), weighed by the recovery plan."""
        self.known = KnownVersions()
        """The committed versions: the store's, read once as the run starts, and each commit since.
        A recovery plans from them and reads no manifest (``recovery/known_versions.py``)."""
        self.memory_period = memory_period
        self._trained_step = 0
        """Rank 0's newest step since the policy was last rebased (the rebase point before it
        reports one): where a lost group is recovered when the policy lost its own count."""

    # ---- events from the runtime --------------------------------------------------------
    def join(
        self, rank: int, world_size: int, worker_id: str, *, captured_step: int | None = None, engine: str = ""
    ) -> ResumeInfo:
        """A rank of a (new) worker group starts; returns, once its group's recovery (if any) is
        done, the :class:`ResumeInfo` every rank of the group gets. Raises :class:`JoinDismissed`.
        ``captured_step``: the newest step a survivor of the current group captured its state at;
        ``engine``: the training engine the rank runs (the summary's and the metrics')."""
        if engine:
            self.view.account.engine = engine
        try:  # the first join of the run reads the store's history; the rest find it read
            self.known.load(self.store)
        except StoreUnavailableError as error:  # read by the first plan instead, which says what failed
            logger.warning("cannot read the store's manifest yet: %s", error)
        event = RankJoined(
            rank=rank,
            world_size=world_size,
            worker_id=worker_id,
            last_complete_step=recovery_step(self._last_complete_step(), captured_step),
            now=self.clock(),
        )
        with self._lock:
            actions = self.supervision.handle(event)
            attempt = self.supervision.attempt
        try:
            self._carry_out(actions)
        except Exception as error:  # recovery itself broke: fail the group (it is restarted), never hang it
            logger.exception("recovery of attempt %d failed", attempt)
            self._execute_dismiss(DismissJoins(attempt=attempt, reason=f"recovery failed: {error!r}"))
            raise
        with self._answered:
            self._answered.wait_for(lambda: attempt in self._published or attempt in self._dismissed)
            if attempt in self._published:
                return self._published[attempt]
            raise JoinDismissed(f"attempt {attempt}: {self._dismissed[attempt]}")

    def _last_complete_step(self) -> int:
        """The policy's last complete step; when it lost its count (its actor was rebuilt after
        its process died), the newest step rank 0 reported since the last rebase: every rank has
        passed that step's collectives, and a survivor's capture one step past it is taken as
        after any loss (``recovery_step``)."""
        complete = self.policy.last_complete_step()
        if complete is not None:
            return complete
        with self._lock:
            trained = self._trained_step
        logger.warning(
            "the policy lost its count of complete steps (rebuilt): rank 0's last step, %d, stands in", trained
        )
        return trained

    def shard_written(self, receipt: ShardReceipt, write_s: float) -> None:
        """A writer wrote one rank's shard; the version's commit (and its retries) run in this call.
        A memory version's shard is held, not written: it joins :attr:`memory_versions`."""
        if receipt.origin == MEMORY_ORIGIN:
            with self._lock:
                self.memory_versions.add(receipt)
            return
        with self._lock:
            self.view.write_latencies.append(write_s)
            actions = self.commits.handle(ShardWritten(receipt=receipt))
        self._carry_out(actions)

    def write_failed(self, layer: str, step: int) -> None:
        """A rank's shard of ``layer`` at ``step`` could not be written (or was refused: the lease
        lapsed): that version will never be whole, so the policy may persist the layer again."""
        with self._lock:
            self.view.write_failures += 1
            self.commits.handle(ShardFailed(layer=layer, step=step))
        self.policy.settled(layer, step)
        self._check_lease()

    def lease_renewed(self, valid_until: float) -> None:
        """The driver's renewal wrote the lease's new expiry, ``valid_until`` (wall clock), to the store."""
        if self.store.term is not None:
            self.store.term.renewed(valid_until)
        self._check_lease()

    def _check_lease(self) -> None:
        """Stop the run once the lease has lapsed (the store then refuses every write and commit)."""
        lapsed = self.store.term.lapsed() if self.store.term is not None else ""
        if lapsed:
            self._lease_lost(lapsed, lapsed_lease=True)

    def writer_died(self, *, lost: list[tuple[str, int]], reason: str, replaced: bool = True) -> None:
        """A rank found its writer dead (``replaced``: this report replaced it; others find it
        replaced already). The versions in ``lost`` (``(layer, step)``) will never be whole: each is
        counted lost once, and the policy may persist those layers again."""
        versions = tuple((str(layer), int(step)) for layer, step in lost)
        with self._lock:
            self.view.writers_replaced += int(replaced)
            self.commits.handle(VersionsLost(versions=versions, reason=reason))
        for layer, step in versions:
            self.policy.settled(layer, step)

    def request_stop(self, reason: str) -> None:
        """Stop the run after the current step (every rank the same): Ctrl-C, a staleness breach."""
        with self._lock:
            first = self.view.stop_reason is None
            if first:
                self.view.stop_reason = reason
        if first:
            self.policy.request_stop(reason)

    def version_unusable(self, version_id: str, reason: str) -> None:
        self._feed(VersionUnusable(version_id=version_id, reason=reason))

    def in_place_refused(self, rank: int, reason: str, detail: str) -> None:
        """A rank of an in-place run raised out of its train function (see ``RunView.in_place_refused``)."""
        logger.warning("rank %d leaves in-place recovery (%s): %s; Ray Train replaces it", rank, reason, detail)
        with self._lock:
            self.view.in_place_refused(FallbackReason(reason, f"rank {rank}: {detail}"))

    def in_place_off(self) -> str | None:
        """Why in-place recovery is off for the rest of the run: the failed recovery's rank and error
        (``None``: it is on)."""
        with self._lock:
            off = self.view.in_place_off
        return off.detail if off is not None else None

    def loaded(
        self, load_s: float, sources: Mapping[str, float] | None = None, *, start: RankStart | None = None
    ) -> None:
        """A rank of the new group loaded its composite (``start``: how it got there)."""
        with self._lock:
            self.view.loaded(load_s, sources, start=start, now=self.clock())

    def progress(self, progress: StepProgress) -> dict[str, int | None]:
        """Rank 0 finished a step; returns each layer's newest committed step (for metrics)."""
        with self._lock:
            self.view.step_done(progress, now=self.clock())
            self._trained_step = max(self._trained_step, progress.step)
            if progress.handed_over:  # versions storage owes from now on
                self.commits.handle(HandedOver(layers=tuple(progress.handed_over), step=progress.step))
            last_steps = self.commits.last_steps()
            breach = self._check_staleness(progress.step)
            timer = self.memory_period
            chosen = (
                timer.observe(step=progress.step, compute_s=progress.compute_s, memory_s=progress.memory_s)
                if timer is not None
                else None
            )
        if chosen is not None:
            self._tell_memory_period(chosen.period)
        if breach is not None and breach.action == "stop":
            self.request_stop(_stop_reason(breach))
        self._check_lease()
        return last_steps

    def _tell_memory_period(self, period: int) -> None:
        """The policy's decisions carry ``period`` to the ranks from its next measured step on."""
        if isinstance(self.policy, SetsMemoryPeriod):
            self.policy.set_memory_period(period)

    def _lease_lost(self, reason: str, *, lapsed_lease: bool = False) -> None:
        """The store's lease is someone else's (``lapsed_lease``: it lapsed, and may be): every rank
        stops after the same step (once)."""
        with self._lock:
            first, self.lease_lost = not self.lease_lost, reason
        if first:
            logger.error("%s: stopping the run", reason)
            self.request_stop(f"{LEASE_LAPSED if lapsed_lease else LEASE_LOST} ({reason})")

    def final_drain(self, drain_s: float) -> tuple[str, ...]:
        """The end of the run: wait for the writers until ``drain_s`` after the last step rank 0
        reported (the deadline the ranks' own final hand-over waits within: ``persistence.stop_drain_s``),
        then count what the writers that did not answer still hold as lost and commit nothing
        more, so the run ends with its summary however long storage hangs. The names of the
        writers that did not answer."""
        last_step_at = self.view.account.last_progress
        now = self.clock()
        left = drain_s if last_step_at is None else max(0.0, last_step_at + drain_s - now)
        unanswered = tuple(self.writers.drain(left))
        self.steps_ended()  # before what is left is written off: a version unanswered all along is a hang
        unfinished: list[tuple[str, int]] = []
        if unanswered and isinstance(self.writers, KnowsUnfinished):
            unfinished = sorted(set(self.writers.unfinished(unanswered)), key=lambda v: (v[1], v[0]))
        reason = (
            f"still in writer(s) {', '.join(unanswered)} {drain_s:g}s after the last step "
            "(persistence.stop_drain_s): storage did not take them in time"
            if unanswered
            else "the run's final drain is over"
        )
        with self._lock:
            self.commits.handle(RunClosed(unfinished=tuple(unfinished), reason=reason))
        if unfinished:
            logger.error(
                "the final drain ended %gs after the last step with %d version(s) unwritten in writer(s) %s: "
                "counted lost",
                drain_s,
                len(unfinished),
                ", ".join(unanswered),
            )
        elif unanswered:  # (a bound already spent asks without waiting: an idle writer may not be in yet)
            logger.info(
                "writer(s) %s had not answered the final drain, and hold nothing unwritten", ", ".join(unanswered)
            )
        return unanswered

    def trained(self) -> bool:
        """Whether rank 0 has reported any trained step, in any attempt."""
        with self._lock:
            return bool(self.view.account.history)

    def worth_retrying(self) -> bool:
        """Whether a new worker group would do other work than the one that just failed before it
        trained (Ray Train's controller: else its error is a setup error, not retried): a step was
        trained, or a rank found a version of the group's plan unusable (a ``--resume`` whose load
        read a corrupt tensor), which the next plan skips."""
        with self._lock:
            return bool(self.view.account.history) or self.supervision.plan_found_unusable

    def steps_ended(self) -> None:
        """No step follows and the writers have drained: the staleness verdict on the final counts
        (failures, and versions storage left unanswered, that came after the last step make a lag
        a breach), stopping the run by config — so the driver reports it as the run's error."""
        with self._lock:
            breach = self._check_staleness(self.view.progress.step, at_end=True)
        if breach is not None and breach.action == "stop":
            self.request_stop(_stop_reason(breach))

    def _check_staleness(self, step: int, *, at_end: bool = False) -> StalenessBreach | None:
        """The guard's verdict at ``step`` on the run's facts now (hold the lock); the view shows
        the breach or lag as the guard keeps it (a breach's counts follow the run's)."""
        facts = self.view.storage_facts(self.commits, now=self.clock())
        breach = self.guard.check(step=step, last_steps=self.commits.last_steps(), facts=facts, at_end=at_end)
        self.view.breach = self.guard.breach.to_json() if self.guard.breach is not None else None
        self.view.staleness_lag = self.guard.lag.to_json() if self.guard.lag is not None else None
        return breach

    def finish(self, ok: bool, reason: str = "") -> None:
        with self._lock:  # failures that came after the final drain; the driver has read its verdict
            self._check_staleness(self.view.progress.step, at_end=True)
        self._carry_out(self._feed(RunEnded(ok=ok, reason=reason or ("" if ok else "the trainer raised"))))

    # ---- views --------------------------------------------------------------------------
    @property
    def state_name(self) -> str:
        return self.supervision.state.name

    def status(self, metrics_url: str | None = None) -> RunStatus:
        """Everything the driver's progress line, the summary and the metrics show."""
        with self._lock:
            state = self.supervision.state
            # the group's size: the running or recovering one's (0 before the first join, and once ended)
            group = state if isinstance(state, (Recovering, Running)) else None
            return self.view.status(
                state=state.name,
                attempt=self.supervision.attempt,
                commits=self.commits,
                metrics_url=metrics_url,
                now=self.clock(),
                world_size=group.world_size if group is not None else 0,
                grown_from=state.grown_from if isinstance(state, Recovering) else 0,
                memory_period=self.memory_period.current.to_json() if self.memory_period is not None else None,
            )

    # ---- carrying out actions -----------------------------------------------------------
    def _feed(self, event: Event) -> list[Action]:
        with self._lock:
            return self.supervision.handle(event)

    def _carry_out(self, actions: Sequence[Step]) -> None:
        """Run ``actions`` in order, outside the lock; a result fed back queues the core's next actions."""
        queue: deque[Step] = deque(actions)
        while queue:
            queue.extend(self._execute(queue.popleft()))

    def _execute(self, action: Step) -> Sequence[Step]:
        if isinstance(action, DrainWriters):
            return self._execute_drain(action)
        if isinstance(action, ReplaceWriters):
            return self._execute_replace_writers(action)
        if isinstance(action, AbandonIncomplete):
            return self._execute_abandon(action)
        if isinstance(action, PlanComposite):
            return self._execute_plan(action)
        if isinstance(action, RebasePolicy):
            return self._execute_rebase(action)
        if isinstance(action, RecordRecovery):
            return self._execute_record(action)
        if isinstance(action, PublishResume):
            return self._execute_publish(action)
        if isinstance(action, DismissJoins):
            return self._execute_dismiss(action)
        return self._execute_commit(action)

    def _execute_drain(self, action: DrainWriters) -> Sequence[Step]:
        self.not_draining.clear()
        try:
            unanswered = self.writers.drain(action.deadline_s)
        finally:
            self.not_draining.set()
        return self._feed(WritersDrained(attempt=action.attempt, unanswered=tuple(unanswered), now=self.clock()))

    def _execute_replace_writers(self, action: ReplaceWriters) -> Sequence[Step]:
        self.writers.replace(action.writers)
        return []

    def _execute_abandon(self, action: AbandonIncomplete) -> Sequence[Step]:
        with self._lock:
            partial = list(self.commits.handle(action))
        self._carry_out(partial)  # committed before the plan (queued next) reads the manifest
        return []

    def _execute_plan(self, action: PlanComposite) -> Sequence[Step]:
        with self._lock:
            if action.t_fail is not None:
                self.memory_versions.forget_after(action.t_fail)
            memory = self.memory_versions.records()
        held = self.writers.held_paths() if memory and isinstance(self.writers, HeldPaths) else None
        planned = plan_composite(
            self.store,
            self.layer_numel,
            action,
            clock=self.clock,
            memory=memory,
            held=held,
            manifest=self.known.manifest(self.store),
        )
        if isinstance(planned, NoComposite) and self.known.pruned:  # every version it kept of some layer failed
            logger.warning("recovery: no composite from the versions kept in memory; reading the store's whole history")
            planned = plan_composite(self.store, self.layer_numel, action, clock=self.clock, memory=memory, held=held)
        return self._feed(planned)

    def _execute_rebase(self, action: RebasePolicy) -> Sequence[Step]:
        with self._lock:  # staleness counts from the versions the group resumes from (a --resume's too)
            self.commits.rebased(action.persisted_steps)
            self._trained_step = action.resume_after
            stop = self.view.stop_reason
        self.policy.restart(
            world_size=action.world_size, resume_after=action.resume_after, persisted_steps=dict(action.persisted_steps)
        )
        if stop is not None:  # a rebuilt policy forgot the run's stop: the new group stops at once, as it would
            self.policy.request_stop(stop)
        timer = self.memory_period
        if timer is not None and timer.current.auto:
            with self._lock:
                timer.group_started()
                period = timer.current
            if period.chosen_at is not None:  # a rebuilt policy started over at its first period: the run's again
                self._tell_memory_period(period.period)
        return []

    def _execute_record(self, action: RecordRecovery) -> Sequence[Step]:
        with self._lock:
            self.view.record_recovery(action)
        return []

    def _execute_publish(self, action: PublishResume) -> Sequence[Step]:
        with self._answered:
            self._published[action.resume.attempt] = action.resume
            self._answered.notify_all()
        return []

    def _execute_dismiss(self, action: DismissJoins) -> Sequence[Step]:
        with self._answered:
            self._dismissed[action.attempt] = action.reason
            self._answered.notify_all()
        return []

    def _execute_commit(self, action: CommitVersion) -> Sequence[Step]:
        if action.delay_s > 0:
            self.sleep(action.delay_s)  # the backoff: this writer's next receipt waits, others do not
        event = self._commit(action)
        if isinstance(event, CommitSucceeded):
            self.known.committed(event.record)
        with self._lock:
            actions = list(self.commits.handle(event))
        if action.partial:
            pass  # the lost group's version: the policy is rebased by the recovery, nothing to settle
        elif isinstance(event, CommitSucceeded):
            self.policy.settled(event.record.layer, event.record.step)
        elif not actions:  # given up (counted lost), or a newer version of the layer is committed
            first = action.receipts[0]
            self.policy.settled(first.layer, first.step)
        return actions

    def _commit(self, action: CommitVersion) -> CommitSucceeded | CommitFailed:
        if self.commits.closed:  # the run's end counted it lost, and the driver gives the store up next
            return CommitFailed(action=action, error=self.commits.closed, retry=False)
        try:
            return CommitSucceeded(record=self.store.commit(list(action.receipts), partial=action.partial))
        except LeaseLostError as error:  # another run owns (or may own) the store now: stop, mix nothing with it
            self._lease_lost(str(error), lapsed_lease=isinstance(error, LeaseLapsedError))
            return CommitFailed(action=action, error=str(error), retry=False)
        except Exception as error:  # storage trouble: retried, then counted lost; training goes on
            return CommitFailed(action=action, error=f"{type(error).__name__}: {error}")
