"""Where a run's wall-clock time went, and its ETTR (effective training time ratio):
productive step time ÷ wall-clock time, with checkpoint stalls, failure detection and restart,
and recovery broken out. Pure bookkeeping over timestamps the supervisor is given.

One file because it is one ledger: :class:`RunAccount` sums the records kept beside it (a rank's
start, a :class:`Recovery` with its phases and sources, the drift probe's cost), and each record's
fields are the ones the account's totals and ``status()`` read."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from layercheck.workers.progress import ProbeCost

#: Where a recovery's elements came from (``Recovery.elements``).
ELEMENT_KINDS = ("capture", "memory", "stored", "initial")
#: A recovery's time from the failure to the next completed step, in the order it is spent
#: (``Recovery.timeline``): the failure noticed, the lost workers torn down and new processes
#: scheduled (the rest of the total once the others are counted); the new processes' start
#: (imports, Ray Train's context); forming the process group; the engine build; the plan (while
#: the engines build, so not part of the sum); the load of the composite; the first step.
RECOVERY_PHASES = ("restart", "start", "group", "build", "plan", "load", "first_step")
#: Why a run that asked for in-place recovery (``cluster.in_place``) recovered by a full restart
#: (``Recovery.fallback``), each with what the summary says of it.
FALLBACK_REASONS = {
    "no_survivor": "no rank survived the failure",
    "rank_failed": "a survivor's own step failed, not for a lost peer",
    "recovery_failed": "a survivor's recovery in its own process failed",
    "in_place_off": "in-place recovery is off since one failed: the survivors left",
}


@dataclass(frozen=True)
class FallbackReason:
    """A rank of an in-place run raised out of its train function. Ray Train replaces the ranks
    that raised, like lost ones: the group restarts whole only when no rank is left running."""

    reason: str
    """One of :data:`FALLBACK_REASONS`."""
    detail: str
    """Which rank, and its error."""

    def __post_init__(self) -> None:
        if self.reason not in FALLBACK_REASONS:
            raise ValueError(f"unknown fallback reason {self.reason!r} (one of {', '.join(FALLBACK_REASONS)})")


@dataclass(frozen=True)
class RankStart:
    """How one rank of a recovering group got to its load, by its own clock."""

    rank: int = -1
    """The rank (-1: not said)."""
    start_s: float = 0.0
    """From its process start to the train function (imports, Ray Train's context); 0 for a
    survivor that kept its process (``cluster.in_place``) and a promoted spare."""
    group_s: float = 0.0
    """Forming the process group, once every rank was there to form it (an in-place run forms its
    own; under a full restart Ray Train forms it before the train function, inside ``start_s``)."""
    build_s: float = 0.0
    """The engine build (model, optimizer, ``deepspeed.initialize``); a user's loop: all its work
    before ``attach`` less the waits for the other ranks (a promoted spare's: since its promotion)."""
    leave_s: float = 0.0
    """A survivor that recovered in its own process: from its loop's error (the peer's loss seen)
    to its loop's rerun (the capture's hand-over, the engine's release, leaving the group)."""
    waited_s: float = 0.0
    """An in-place rank of a user's loop: its wait for the other ranks to form the group with (their
    time, not its own: a replacement's start, a spare's promotion); in no phase of its own."""
    kept_process: bool = False
    """A survivor that recovered in its own process."""
    spare: bool = False
    """A warm spare promoted to a lost rank (``cluster.spares``): its model was built before."""

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class Recovery:
    t_fail: int
    """The last step every rank completed before the failure."""
    resumed_at: int
    """The step training continued from (t_fail + 1 with a composite, 1 without)."""
    detect_restart_s: float
    """From the last progress of the lost group to the new group asking to resume."""
    plan_s: float = 0.0
    """Draining the writers, reading the manifest and planning the composite."""
    drain_s: float = 0.0
    """Of ``plan_s``, the writers' drain (what the lost group handed over, written first)."""
    load_s: float = 0.0
    """The slowest rank's load of its slices into the new engine."""
    weighted_staleness: float = 0.0
    max_staleness: int = 0
    steps_redone: int = 0
    """Steps trained again because no composite was usable (0 when LayerCheck recovers)."""
    sources: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Per layer, where the composite's elements came from: ``origin`` (``capture``: a
    survivor's hand-over; ``policy``: a scheduled snapshot; ``initial``: the rebuilt step-0
    state), ``version_id``, ``step``, ``ranks``,
    ``elements`` (``LayerSource.to_json``), newest first."""

    @property
    def elements(self) -> dict[str, int]:
        """Elements recovered from survivors' captures, from the writers' memory versions, from
        stored (scheduled) versions and from the run's rebuilt initial state (layers not saved yet)."""
        out = dict.fromkeys(ELEMENT_KINDS, 0)
        for layer_sources in self.sources.values():
            for s in layer_sources:
                out[s["origin"] if s["origin"] in ("capture", "memory", "initial") else "stored"] += s["elements"]
        return out

    world_size: int = 0
    """The workers training resumed with (0: not known)."""
    grown_from: int = 0
    """Ray Train grew the elastic group from this many workers (a restart, not a failure); 0: not a grow."""
    kind: str = "failure"
    """``failure`` (a lost worker group), ``grow`` (an elastic group grown back) or ``resume``
    (``--resume`` of a stopped run from its store): only failures are failures."""
    attempt: int = 0
    """The worker group attempt training resumed under (0: not known). A survivors' capture of
    group ``a`` serves the first recovery with ``attempt > a``."""
    memory_local_bytes: int = 0
    """Shard-file bytes the ranks loaded from a writer's memory on their own node (all ranks)."""
    memory_local_shards: int = 0
    memory_remote_bytes: int = 0
    """… from a writer's memory on another node (a mirror copy, or a rank that moved)."""
    memory_remote_shards: int = 0
    storage_bytes: int = 0
    """… from storage: files no writer held (bytes of the files opened; a re-slicing rank reads
    only the ranges it needs of them)."""
    storage_shards: int = 0
    memory_rejected: int = 0
    """Copies in memory that failed their checksum (read from the next copy or storage instead)."""
    since: float = 0.0
    """When the lost group last made progress (the supervisor's clock): the failure came after."""
    start_s: float = 0.0
    """The new group's slowest rank, from its process start to the train function (imports, Ray
    Train's context; under a full restart the process group too)."""
    group_s: float = 0.0
    """The slowest rank's forming of the process group (an in-place run's, see ``RankStart``)."""
    build_s: float = 0.0
    """The slowest rank's engine build (model, optimizer, ``deepspeed.initialize``); the plan runs
    meanwhile."""
    kept_processes: int = 0
    """Ranks that recovered in their own process (``cluster.in_place``); 0: a full restart."""
    spares_promoted: int = 0
    """Warm spares that took a lost rank's place (``cluster.spares``)."""
    ready_at: float = 0.0
    """When the last rank said its composite was loaded (the supervisor's clock; 0: none said)."""
    first_step_s: float | None = None
    """From the last rank's load to the first step the new group completed."""
    failure_to_step_s: float | None = None
    """From the lost group's last progress to the first step the new group completed: the whole
    recovery, as training sees it (``None`` until that step)."""
    in_place: bool = False
    """The run asked for in-place recovery (``cluster.in_place``)."""
    refused: FallbackReason | None = None
    """What a rank said as it left in-place recovery (``None``: none said anything)."""
    interrupted: bool = False
    """The next failure came before this recovery's group completed a step (its record is
    incomplete: what its ranks measured until then)."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """Each rank's own phases as it said them (a ``RankStart`` and its ``load_s``), in the order
    they loaded: a survivor's (``kept_process``) beside a replacement's or a promoted spare's."""

    @property
    def total_s(self) -> float:
        """The whole recovery once its first step is done; until then the parts known so far."""
        if self.failure_to_step_s is not None:
            return self.failure_to_step_s
        return self.detect_restart_s + self.plan_s + self.load_s

    @property
    def path(self) -> str:
        """``in place`` (survivors kept their processes, or a warm spare took the lost rank's
        place), ``full restart``, or ``interrupted`` (the next failure came before any of its
        ranks loaded, often: nothing tells which it was)."""
        if self.interrupted:
            return "interrupted"
        return "in place" if self.kept_processes or self.spares_promoted else "full restart"

    @property
    def fallback(self) -> str:
        """Why this failure's recovery was a full restart although the run asked for in place (one
        of :data:`FALLBACK_REASONS`); "" when it ran in place or the run did not ask for it."""
        if not self.in_place or self.path == "in place" or self.kind != "failure" or self.interrupted:
            return ""  # (an interrupted one never got as far as its ranks' loads: no path to judge)
        return self.refused.reason if self.refused is not None else "no_survivor"

    def timeline(self) -> dict[str, float]:
        """Seconds of each of :data:`RECOVERY_PHASES`, each the slowest rank's. Once the first
        step is done they add up to the total, the plan aside (it runs during the build): the
        ``restart`` is what the measured phases leave of it (noticing the failure, the teardown,
        scheduling the new processes). Until then it is the time to the first join, less the start."""
        measured = self.start_s + self.group_s + self.build_s + self.load_s + (self.first_step_s or 0.0)
        if self.failure_to_step_s is not None:
            restart = self.failure_to_step_s - measured
        else:
            restart = self.detect_restart_s - self.start_s
        return {
            "restart": max(0.0, restart),
            "start": self.start_s,
            "group": self.group_s,
            "build": self.build_s,
            "plan": self.plan_s,
            "load": self.load_s,
            "first_step": self.first_step_s or 0.0,
        }

    def rank_ready(self, start: RankStart, *, now: float, load_s: float = 0.0) -> None:
        """A rank of the new group loaded its composite (in ``load_s``): how it got there (its own clock)."""
        self.ranks.append({**start.to_json(), "load_s": load_s})
        self.start_s = max(self.start_s, start.start_s)
        self.group_s = max(self.group_s, start.group_s)
        self.build_s = max(self.build_s, start.build_s)
        self.kept_processes += int(start.kept_process)
        self.spares_promoted += int(start.spare)
        self.ready_at = max(self.ready_at, now)

    def add_sources(self, sources: Mapping[str, float]) -> None:
        """Add one rank's ``LoadSources`` (``orchestrator/core/memory/reads.py``) to the totals."""
        for name in LOAD_SOURCE_FIELDS:
            setattr(self, name, getattr(self, name) + int(sources.get(name, 0)))


#: The per-source counts a rank's load reports (see ``Recovery.add_sources``).
LOAD_SOURCE_FIELDS = (
    "memory_local_bytes",
    "memory_local_shards",
    "memory_remote_bytes",
    "memory_remote_shards",
    "storage_bytes",
    "storage_shards",
    "memory_rejected",
)


@dataclass
class ProbeAccount:
    """What rank 0's drift probe cost over the run: every step it reported, kept or lost to a
    failure (the work was done either way)."""

    probe: str | None = None
    """The probe of the last report (the same for a run unless its engine changed)."""
    seconds: float = 0.0
    steps: int = 0
    measured_steps: int = 0
    replaced_steps: int = 0
    """Measured steps whose timed work was a whole update in place of the optimizer's step
    (:attr:`ProbeCost.replaced`), and that own step, timed on ``own_steps`` unmeasured steps."""
    own_seconds: float = 0.0
    own_steps: int = 0

    def add(self, cost: ProbeCost) -> None:
        self.probe = cost.probe
        self.seconds += cost.seconds
        self.steps += 1
        self.measured_steps += int(cost.measured)
        self.replaced_steps += int(cost.replaced)
        self.own_seconds += cost.own_step_s
        self.own_steps += cost.own_steps

    def summary(self) -> dict[str, Any] | None:
        """The figures the run's summary shows (``None``: no step reported a probe)."""
        if self.probe is None:
            return None
        per_measured = self.seconds / self.measured_steps if self.measured_steps else 0.0
        figures = {
            "probe": self.probe,
            "seconds": self.seconds,
            "steps": self.steps,
            "measured_steps": self.measured_steps,
            "s_per_measured_step": per_measured,
            "s_per_step": self.seconds / self.steps,
        }
        if self.own_steps and self.replaced_steps and self.measured_steps:  # beyond the own steps it replaced
            own = self.own_seconds / self.own_steps
            added = self.seconds - self.replaced_steps * own
            figures |= {
                "own_steps": self.own_steps,
                "s_per_own_step": own,
                "added_s_per_measured_step": added / self.measured_steps,
                "added_s_per_step": added / self.steps,
            }
        return figures


@dataclass
class RunAccount:
    """Timings of one run, as the supervisor learns them."""

    started: float
    step_seconds: dict[int, float] = field(default_factory=dict)
    """Per step kept in the final trajectory: the slowest-rank compute time (rank 0 reports)."""
    stall_seconds: float = 0.0
    """Training-loop time spent handing snapshots over (device→host copy, backpressure)."""
    stalls: int = 0
    lost_step_seconds: float = 0.0
    """Compute of steps after the last completed one of a lost group (never counted)."""
    recoveries: list[Recovery] = field(default_factory=list)
    failures: int = 0
    last_progress: float | None = None
    last_step: int = 0
    history: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Per step of the final trajectory: (loss, learning rate)."""

    coordination_seconds: list[float] = field(default_factory=list)
    """Per step reported, rank 0's time in the policy protocol (drift report + decision)."""
    probe: ProbeAccount = field(default_factory=ProbeAccount)
    engine: str = ""
    """The training engine the ranks said they run (``deepspeed``, ``fsdp2``; ``""`` before any joined)."""

    def step_done(
        self,
        step: int,
        compute_s: float,
        stall_s: float,
        now: float,
        *,
        loss: float = float("nan"),
        lr: float = 0.0,
        coordination_s: float = 0.0,
    ) -> None:
        self.step_seconds[step] = compute_s
        self.coordination_seconds.append(coordination_s)
        self.history[step] = (loss, lr)
        if stall_s > 0:
            self.stall_seconds += stall_s
            self.stalls += 1
        self.last_progress = now
        self.last_step = max(self.last_step, step)
        recovery = self.recoveries[-1] if self.recoveries else None
        if recovery is not None and recovery.failure_to_step_s is None and step >= recovery.resumed_at:
            recovery.failure_to_step_s = max(0.0, now - recovery.since)
            recovery.first_step_s = max(0.0, now - recovery.ready_at) if recovery.ready_at else None

    def failed(self, *, t_fail: int, resumed_at: int, now: float, lost_group: bool = True) -> Recovery:
        """A worker group was lost after completing ``t_fail`` (or, with ``lost_group=False``, a
        stopped run resumes from its store); steps after it do not count."""
        self.failures += int(lost_group)
        if self.recoveries and self.recoveries[-1].failure_to_step_s is None:
            self.recoveries[-1].interrupted = True  # overtaken before its first step
        for step in [s for s in self.step_seconds if s > t_fail or s >= resumed_at]:
            self.lost_step_seconds += self.step_seconds.pop(step)
            self.history.pop(step, None)
        since = self.last_progress if self.last_progress is not None else self.started
        recovery = Recovery(
            t_fail=t_fail,
            resumed_at=resumed_at,
            detect_restart_s=max(0.0, now - since),
            steps_redone=max(0, t_fail + 1 - resumed_at),
            since=since,
        )
        self.recoveries.append(recovery)
        self.last_step = resumed_at - 1
        return recovery

    @property
    def productive_s(self) -> float:
        return sum(self.step_seconds.values())

    def ettr(self, now: float) -> float:
        wall = now - self.started
        return min(1.0, self.productive_s / wall) if wall > 0 else 0.0

    def summary(self, now: float) -> dict[str, object]:
        return {
            "wall_s": now - self.started,
            "productive_s": self.productive_s,
            "stall_s": self.stall_seconds,
            "stalls": self.stalls,
            "lost_step_s": self.lost_step_seconds,
            "failures": self.failures,
            "recoveries": [
                asdict(r)
                | {
                    "total_s": r.total_s,
                    "elements": r.elements,
                    "timeline": r.timeline(),
                    "path": r.path,
                    "fallback": r.fallback,
                }
                for r in self.recoveries
            ],
            "recovered_elements": {kind: sum(r.elements[kind] for r in self.recoveries) for kind in ELEMENT_KINDS},
            "ettr": self.ettr(now),
            "coordination_s_per_step": _percentiles(self.coordination_seconds),
            "drift_probe": self.probe.summary(),
            "engine": self.engine,
            "step_s_per_step": _percentiles(list(self.step_seconds.values())),
            "history": {step: list(values) for step, values in sorted(self.history.items())},
        }


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0.0}
    ordered = sorted(values)
    return {
        "mean": sum(ordered) / len(ordered),
        "p50": ordered[len(ordered) // 2],
        "p90": ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))],
        "max": ordered[-1],
    }


def format_sources(sources: dict[str, list[dict[str, Any]]]) -> str:
    """Where a recovery's elements came from, by origin and step: ``capture@14 21,000 (3 layers);
    policy@10 63,000 (4 layers)`` — newest first."""
    shares: dict[tuple[str, int], list[int]] = {}
    for layer_sources in sources.values():
        for source in layer_sources:
            if source["elements"]:
                share = shares.setdefault((source["origin"], source["step"]), [0, 0])
                share[0] += source["elements"]
                share[1] += 1
    ordered = sorted(shares.items(), key=lambda item: (-item[0][1], item[0][0]))
    return "; ".join(
        f"{origin}@{step} {n:,} ({layers} layer{'s' if layers != 1 else ''})" for (origin, step), (n, layers) in ordered
    )
