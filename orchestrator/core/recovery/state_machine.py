"""Membership and recovery of a run's worker groups, as an explicit state machine without Ray.

API (for a runtime shell; :class:`~layercheck.orchestrator.core.run_supervisor.RunSupervisor` is a ready one,
thread-safe, that any runtime can host)::

    sup = RecoveryMachine(config=SupervisionConfig(), resume=False)
    actions = sup.handle(event)      # one event in, the actions to carry out out; never blocks
    sup.state                        # Starting | Recovering | Running | Finished | Failed
    sup.state.name, sup.attempt      # "running", ...; the newest worker group's attempt

The shell feeds events (:mod:`layercheck.orchestrator.core.recovery.events`) and carries out the actions
it gets back, in order, feeding the result of each one that has one back in:

====================  =========================================================================
action                the shell
====================  =========================================================================
DrainWriters          waits up to ``deadline_s`` for the writers; feeds ``WritersDrained``
ReplaceWriters        stops handing out (and kills) the writers named; new ones start on demand
AbandonIncomplete     ``CommitPath.handle(action)``: drops the lost group's partial versions
PlanComposite         ``plan_composite(store, ...)`` (:mod:`.recovery_plan`); feeds its result
RebasePolicy          ``PolicyService.restart(...)``
RecordRecovery        ``RunView.record_recovery(action)``
PublishResume         answers every rank of the attempt (waiting or later) with the ResumeInfo
DismissJoins          fails the joins still waiting on an attempt a newer group replaced
====================  =========================================================================

The machine: the first join starts attempt 1, fresh (``Running`` at step 1) or, resuming a
stopped run, through ``Recovering``. A join whose rank is already a member under another worker
id, or whose group has another size (an elastic group Ray Train shrank or grew: its first join may
be any rank), is the first of a new group: the old one was lost after ``t_fail`` (the policy's last
complete step, carried by the join), and recovery drains the writers, plans the composite at ``t_fail`` and
rebases the policy before the ranks are answered with ``t_fail + 1`` — or step 1 from the initial
weights when no composite exists (a failure in warm-up); a ``--resume``'s group lost before it trained
a step (a rank's load found a version corrupt: :attr:`RecoveryMachine.plan_found_unusable`) is
resumed again as the ``--resume`` was, without that version. A new group during a recovery overtakes
it: the recovery restarts under the new attempt and the stale results of the old one are dropped.
A join retried by the same worker changes nothing. ``handle`` is not thread-safe: a shell with
threads serialises calls to it (and carries out actions outside that lock).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar

from layercheck.orchestrator.core.recovery.config import SupervisionConfig
from layercheck.orchestrator.core.recovery.events import (
    AbandonIncomplete,
    Action,
    CompositePlanned,
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

logger = logging.getLogger(__name__)


# ---- states ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Starting:
    name: ClassVar[str] = "starting"
    terminal: ClassVar[bool] = False
    resume: bool = False
    """The run continues the versions already in the store (``layercheck train --resume``)."""


@dataclass(frozen=True, kw_only=True)
class Recovering:
    name: ClassVar[str] = "recovering"
    terminal: ClassVar[bool] = False
    attempt: int
    world_size: int
    members: Mapping[int, str]
    lost_group: bool
    """A worker group was lost (else: a stopped run resumes from its store)."""
    t_fail: int | None
    """The lost group's last complete step; ``None``: the store's newest recoverable step."""
    detected_at: float
    phase: str
    """``draining`` the writers, then ``planning`` the composite."""
    drained_at: float | None = None
    """When the writers' drain ended (``None``: not drained, or nothing to drain)."""
    groups_lost: int = 1
    """Groups lost since training last ran: more than 1 when a group was lost during recovery."""
    grown_from: int = 0
    """Ray Train grew the elastic group (room came back): the old group's size; 0: not a grow."""


@dataclass(frozen=True, kw_only=True)
class Running:
    name: ClassVar[str] = "running"
    terminal: ClassVar[bool] = False
    attempt: int
    world_size: int
    members: Mapping[int, str]
    resume: ResumeInfo
    from_store: bool = False
    """Its composite is a ``--resume``'s: planned at the store's newest recoverable step, not at
    a lost group's ``t_fail``."""


@dataclass(frozen=True)
class Finished:
    name: ClassVar[str] = "finished"
    terminal: ClassVar[bool] = True


@dataclass(frozen=True)
class Failed:
    name: ClassVar[str] = "failed"
    terminal: ClassVar[bool] = True
    reason: str = ""


State = Starting | Recovering | Running | Finished | Failed
STATE_NAMES = tuple(s.name for s in (Starting, Running, Recovering, Finished, Failed))


# ---- the machine -----------------------------------------------------------------------------
@dataclass(kw_only=True)
class RecoveryMachine:
    """The membership and recovery machine: :meth:`handle` one event at a time."""

    config: SupervisionConfig = field(default_factory=SupervisionConfig)
    resume: bool = False
    state: State = field(init=False)
    unusable: dict[str, str] = field(default_factory=dict)
    """version id → why a rank found it unusable; every later plan skips these."""
    _last_attempt: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.state = Starting(self.resume)

    @property
    def attempt(self) -> int:
        """The newest worker group's attempt (0 before the first join)."""
        return self._last_attempt

    @property
    def plan_found_unusable(self) -> bool:
        """A rank found a version of the running group's composite unusable: the next group's
        plan skips it, so a retry does not repeat what failed."""
        state = self.state
        if not isinstance(state, Running) or state.resume.records is None:
            return False
        chosen = {r.version_id for r in state.resume.records.values()}
        chosen |= {o.version_id for layer in state.resume.overlays.values() for o in layer}
        return not chosen.isdisjoint(self.unusable)

    def handle(self, event: Event) -> list[Action]:
        """Take one event; move to the next state; return the actions to carry out, in order."""
        if isinstance(event, VersionUnusable):
            logger.error("version %s is unusable (%s): later plans skip it", event.version_id, event.reason)
            self.unusable[event.version_id] = event.reason
            return []
        if self.state.terminal:
            logger.info("ignoring %s: the run is %s", type(event).__name__, self.state.name)
            return []
        if isinstance(event, RunEnded):
            return self._end(event)
        if isinstance(event, RankJoined):
            return self._joined(event)
        if isinstance(event, WritersDrained):
            return self._drained(event)
        if isinstance(event, (CompositePlanned, NoComposite)):
            return self._planned(event)
        raise TypeError(f"not a supervision event: {event!r}")

    def _move(self, state: State, why: str) -> None:
        # a state between groups (starting, ended) has no attempt of its own: the last group's stands
        attempt = state.attempt if isinstance(state, (Recovering, Running)) else self._last_attempt
        logger.info("supervision: %s -> %s (attempt %d): %s", self.state.name, state.name, attempt, why)
        self.state = state
        self._last_attempt = attempt

    # ---- events ---------------------------------------------------------------------------
    def _end(self, event: RunEnded) -> list[Action]:
        actions: list[Action] = []
        if isinstance(self.state, Recovering):
            actions.append(DismissJoins(attempt=self.state.attempt, reason="the run ended"))
        if event.ok:
            self._move(Finished(), "the trainer returned")
        else:
            self._move(Failed(event.reason), f"the trainer failed: {event.reason or 'no reason given'}")
        return actions

    def _joined(self, event: RankJoined) -> list[Action]:
        state = self.state
        if isinstance(state, Starting):
            return self._first_group(event, resume=state.resume)
        assert isinstance(state, (Running, Recovering))
        known = state.members.get(event.rank)
        if known == event.worker_id:
            logger.info("rank %d (%s) joined again: a retried call, same answer", event.rank, event.worker_id)
            return []
        if known is not None or event.world_size != state.world_size:
            # a group of another size is new whichever rank joins first (Ray Train resized it): a
            # rank the old group never had would otherwise join the old attempt and get its answer
            return self._group_lost(state, event)
        self.state = replace(state, members={**state.members, event.rank: event.worker_id})
        logger.info("rank %d of %d joined attempt %d", event.rank, state.world_size, state.attempt)
        return []

    def _first_group(self, event: RankJoined, *, resume: bool) -> list[Action]:
        members = {event.rank: event.worker_id}
        if not resume:
            info = ResumeInfo(1, 1)
            self._move(
                Running(attempt=1, world_size=event.world_size, members=members, resume=info),
                f"a fresh start with {event.world_size} workers from the initial weights",
            )
            return [
                RebasePolicy(world_size=event.world_size, resume_after=0, persisted_steps={}),
                PublishResume(resume=info),
            ]
        self._move(
            Recovering(
                attempt=1,
                world_size=event.world_size,
                members=members,
                lost_group=False,
                t_fail=None,
                detected_at=event.now,
                phase="planning",
            ),
            f"--resume: continue the stored run at its newest recoverable step with {event.world_size} workers",
        )
        return [PlanComposite(attempt=1, t_fail=None, skip=dict(self.unusable))]

    def _group_lost(self, state: Running | Recovering, event: RankJoined) -> list[Action]:
        attempt = state.attempt + 1
        actions: list[Action] = []
        grown_from = state.world_size if event.world_size > state.world_size else 0
        t_fail: int | None  # None: a --resume's recovery, which has no failure step
        if isinstance(state, Running):
            t_fail, lost_group, groups = event.last_complete_step, True, 1
            why = (
                f"rank {event.rank} joined as a new worker ({event.worker_id}): the group of attempt "
                f"{state.attempt} was lost after step {t_fail}; recovering with {event.world_size} workers"
            )
            if state.from_store and not grown_from and event.last_complete_step < state.resume.start_step:
                # lost in a --resume's load (a corrupt tensor, say) before it trained a step: the
                # retry plans as the --resume did, from the store's versions it still finds usable
                t_fail = None
                why = (
                    f"rank {event.rank} joined as a new worker ({event.worker_id}): the group of attempt "
                    f"{state.attempt} was lost before it trained a step of the --resume; resuming again "
                    f"with {event.world_size} workers"
                )
            if grown_from:
                groups = 0  # a planned restart (Ray Train's elastic policy found room), not a failure
                why = (
                    f"rank {event.rank} joined a group of {event.world_size} workers ({event.worker_id}): "
                    f"Ray Train grew the group of attempt {state.attempt} ({state.world_size} -> "
                    f"{event.world_size} workers) after step {t_fail}; resuming it like a recovery"
                )
        else:  # lost again before recovery ended: nothing trained since, so the same t_fail
            t_fail, lost_group, groups = state.t_fail, state.lost_group, state.groups_lost + 1
            actions.append(DismissJoins(attempt=state.attempt, reason=f"attempt {attempt} replaced it"))
            why = (
                f"rank {event.rank} joined as a new worker while attempt {state.attempt} was still "
                f"{state.phase}: that group was lost too; recovery starts over"
            )
        logger.warning("supervision: %s", why)
        phase = "draining" if lost_group else "planning"
        self._move(
            Recovering(
                attempt=attempt,
                world_size=event.world_size,
                members={event.rank: event.worker_id},
                lost_group=lost_group,
                t_fail=t_fail,
                detected_at=event.now,
                phase=phase,
                groups_lost=groups,
                grown_from=grown_from,
            ),
            why,
        )
        if lost_group:
            actions.append(DrainWriters(attempt=attempt, deadline_s=self.config.drain_deadline_s))
        else:
            actions.append(PlanComposite(attempt=attempt, t_fail=t_fail, skip=dict(self.unusable)))
        return actions

    def _current(self, attempt: int, phase: str, what: str) -> Recovering | None:
        state = self.state
        if isinstance(state, Recovering) and state.attempt == attempt and state.phase == phase:
            return state
        logger.info(
            "dropping %s of attempt %d: the supervisor is %s (attempt %d)",
            what,
            attempt,
            state.name,
            self._last_attempt,
        )
        return None

    def _drained(self, event: WritersDrained) -> list[Action]:
        state = self._current(event.attempt, "draining", "a drain result")
        if state is None:
            return []
        actions: list[Action] = []
        if event.unanswered:
            reason = (
                f"writer(s) {', '.join(event.unanswered)} did not answer the drain (dead with their node or "
                f"process, or not done within {self.config.drain_deadline_s:g}s: config drain_deadline_s)"
            )
            logger.error("supervision: %s: their versions are lost; recovering from what is committed", reason)
            actions += [
                ReplaceWriters(writers=tuple(event.unanswered)),
                AbandonIncomplete(reason=reason, lost=True, keep_upto=state.t_fail),
            ]
        else:
            actions.append(
                AbandonIncomplete(reason=f"the group of attempt {state.attempt - 1} was lost", keep_upto=state.t_fail)
            )
        at = "the store's newest recoverable step" if state.t_fail is None else f"step {state.t_fail}"
        self._move(
            replace(state, phase="planning", drained_at=event.now), f"writers drained; planning the composite at {at}"
        )
        actions.append(PlanComposite(attempt=state.attempt, t_fail=state.t_fail, skip=dict(self.unusable)))
        return actions

    def _planned(self, event: CompositePlanned | NoComposite) -> list[Action]:
        state = self._current(event.attempt, "planning", "a composite plan")
        if state is None:
            return []
        if isinstance(event, CompositePlanned):
            resume_after, records, overlays = event.t_fail, dict(event.records), dict(event.overlays)
            max_staleness, weighted, sources = event.max_staleness, event.weighted_staleness, dict(event.sources)
            # the policy's last persisted step stays the whole version's: a capture holds only
            # the survivors' slices, so a layer's next scheduled save is still due as before
            persisted = {layer: record.step for layer, record in records.items()}
            why = (
                f"resuming at step {resume_after + 1} from a composite at step {event.t_fail}: max staleness "
                f"{event.max_staleness}, weighted {event.weighted_staleness:.1f}"
                + (f"; partial versions overlaid on {len(overlays)} layer(s)" if overlays else "")
            )
        else:
            resume_after, records, overlays, persisted = 0, None, {}, {}
            max_staleness, weighted, sources = 0, 0.0, {}
            why = (
                f"no composite at step {event.t_fail} ({event.reason}): training restarts from the "
                "initial weights at step 1"
            )
            logger.warning("supervision: %s", why)
        info = ResumeInfo(state.attempt, resume_after + 1, records, overlays)
        record = RecordRecovery(
            t_fail=event.t_fail,
            resumed_at=resume_after + 1,
            lost_group=state.lost_group,
            detected_at=state.detected_at,
            plan_s=max(0.0, event.now - state.detected_at),
            drain_s=max(0.0, state.drained_at - state.detected_at) if state.drained_at is not None else 0.0,
            groups_lost=state.groups_lost if state.lost_group else 0,
            world_size=state.world_size,
            grown_from=state.grown_from,
            attempt=state.attempt,
            max_staleness=max_staleness,
            weighted_staleness=weighted,
            sources=sources,
        )
        running = Running(
            attempt=state.attempt,
            world_size=state.world_size,
            members=state.members,
            resume=info,
            from_store=state.t_fail is None and records is not None,
        )
        self._move(running, why)
        return [
            RebasePolicy(world_size=state.world_size, resume_after=resume_after, persisted_steps=persisted),
            record,
            PublishResume(resume=info),
        ]
