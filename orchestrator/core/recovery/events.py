"""The values the supervision core exchanges with its shell: the events it is fed, the actions it
returns, and :class:`ResumeInfo`, what every rank of a group is told (its config:
:mod:`layercheck.orchestrator.core.recovery.config`).

Events are facts the shell observed (a rank joined, the writers drained, a plan was made);
actions are what the shell must carry out next (drain the writers, plan a composite, rebase the
policy, publish the resume point). Every event and action of a recovery carries its ``attempt``,
so the result of an action that belongs to an attempt overtaken by a newer failure is recognised
and dropped. See :mod:`layercheck.orchestrator.core.recovery.state_machine` for the machine and its API.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from layercheck.orchestrator.store.manifest import VersionRecord
from layercheck.policies.overlay import LayerSource


@dataclass(frozen=True)
class ResumeInfo:
    """What every rank of a worker group is told when it joins."""

    attempt: int
    start_step: int
    """The first step to train (1 on a fresh start, t_fail + 1 after a recovery)."""
    records: Mapping[str, VersionRecord] | None = None
    """Per layer, the committed version to load; ``None``: start from the initial weights."""
    overlays: Mapping[str, tuple[VersionRecord, ...]] = field(default_factory=dict)
    """Per layer, partial versions (survivors' captures) whose elements replace ``records``'
    ones, newest first; layers without any are absent."""


# ---- events: what the shell observed ---------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RankJoined:
    """A rank of a worker group starts and asks where to begin. ``last_complete_step`` is the
    policy's newest step every rank completed, read by the shell just before: the ``t_fail`` of
    a lost group if this join turns out to be the first of a new one."""

    rank: int
    world_size: int
    worker_id: str
    last_complete_step: int
    now: float


@dataclass(frozen=True, kw_only=True)
class WritersDrained:
    """The drain of a recovery ended: every writer answered, or the deadline passed and the
    writers named in ``unanswered`` did not."""

    attempt: int
    unanswered: tuple[str, ...] = ()
    now: float = 0.0
    """When the drain ended (the supervisor's clock): the recovery's drain is timed apart from its plan."""


@dataclass(frozen=True, kw_only=True)
class CompositePlanned:
    attempt: int
    t_fail: int
    records: Mapping[str, VersionRecord]
    max_staleness: int
    weighted_staleness: float
    """Element-weighted: elements from a partial version at step s are ``t_fail - s`` stale."""
    now: float
    overlays: Mapping[str, tuple[VersionRecord, ...]] = field(default_factory=dict)
    """Per layer, the partial versions overlaid on its whole version, newest first."""
    sources: Mapping[str, tuple[LayerSource, ...]] = field(default_factory=dict)
    """Per layer, where its elements come from (origin, version, step, ranks, elements)."""


@dataclass(frozen=True, kw_only=True)
class NoComposite:
    """No layer-complete composite exists at ``t_fail`` (a failure in warm-up, before the base)."""

    attempt: int
    t_fail: int
    reason: str
    now: float


@dataclass(frozen=True, kw_only=True)
class VersionUnusable:
    """A rank found a version corrupt while loading it: later plans skip it."""

    version_id: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class RunEnded:
    ok: bool
    reason: str = ""


Event = RankJoined | WritersDrained | CompositePlanned | NoComposite | VersionUnusable | RunEnded


# ---- actions: what the shell carries out -----------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class DrainWriters:
    """Wait up to ``deadline_s`` for every writer to write and commit what it holds; then feed
    :class:`WritersDrained` naming the writers that did not answer."""

    attempt: int
    deadline_s: float


@dataclass(frozen=True, kw_only=True)
class ReplaceWriters:
    """Stop using (and kill) these writers: they did not answer a drain. New ones start on demand."""

    writers: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class AbandonIncomplete:
    """The lost group's half-written versions will never complete: drop them from the commit
    path; with ``lost`` set, count them as lost versions (a writer holding them never answered)."""

    reason: str
    lost: bool = False
    keep_upto: int | None = None
    """Versions at or before this step (the lost group's ``t_fail``) that some ranks wrote are
    committed as partial versions — the survivors' slices, fresher than any whole version."""


@dataclass(frozen=True, kw_only=True)
class PlanComposite:
    """Plan the composite at ``t_fail`` (``None``: the store's newest recoverable step), skipping
    the versions in ``skip``; feed :class:`CompositePlanned` or :class:`NoComposite`."""

    attempt: int
    t_fail: int | None
    skip: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RebasePolicy:
    """Restart the policy service for a group of ``world_size`` resuming after ``resume_after``,
    each layer's staleness counted from ``persisted_steps``."""

    world_size: int
    resume_after: int
    persisted_steps: Mapping[str, int]


@dataclass(frozen=True, kw_only=True)
class RecordRecovery:
    """Account a recovery: the run lost ``t_fail``'s group (or, ``lost_group=False``, resumes a
    stopped run) at ``detected_at`` and resumes at ``resumed_at``; planning took ``plan_s``."""

    t_fail: int
    resumed_at: int
    lost_group: bool
    detected_at: float
    plan_s: float
    drain_s: float = 0.0
    """Of ``plan_s``, the writers' drain: waiting for what the lost group handed over to be written
    (bounded by what was in flight, so by storage's speed), before the plan proper."""
    groups_lost: int = 1
    """Worker groups lost since training last ran (0 when a stopped run resumes, or when Ray Train
    grew the group and none was lost meanwhile)."""
    max_staleness: int = 0
    weighted_staleness: float = 0.0
    sources: Mapping[str, tuple[LayerSource, ...]] = field(default_factory=dict)
    """Per layer, where the composite's elements came from (empty without a composite)."""
    world_size: int = 0
    """The workers training resumes with."""
    grown_from: int = 0
    """Ray Train grew the elastic group from this many workers (0: not a grow)."""
    attempt: int = 0
    """The worker group attempt training resumes under (the broken group's, and any lost during
    the recovery, are lower)."""


@dataclass(frozen=True, kw_only=True)
class PublishResume:
    """Answer every rank of ``resume.attempt``, waiting or yet to join, with ``resume``."""

    resume: ResumeInfo


@dataclass(frozen=True, kw_only=True)
class DismissJoins:
    """Ranks still waiting on ``attempt`` will never be answered: a newer group replaced theirs."""

    attempt: int
    reason: str


Action = (
    DrainWriters
    | ReplaceWriters
    | AbandonIncomplete
    | PlanComposite
    | RebasePolicy
    | RecordRecovery
    | PublishResume
    | DismissJoins
)
