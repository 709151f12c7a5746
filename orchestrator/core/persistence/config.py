"""The persistence package's own config: the run file's ``[persistence]`` table (the writers that
move layer snapshots to storage, the in-memory tier, survivors' captures, what a storage breach
does), also :class:`layercheck.PersistenceConfig` for a user's own loop."""

from __future__ import annotations

from dataclasses import dataclass, field

from layercheck.orchestrator.core.memory.auto_period import AUTO, MemoryPeriodSetting
from layercheck.orchestrator.core.persistence.staleness_guard import BREACH_ACTIONS, DEFAULT_HUNG_WRITE_S
from layercheck.orchestrator.core.persistence.write_budget import WriteBudgetConfig
from layercheck.policies.config_loader import require


@dataclass(frozen=True, kw_only=True)
class PersistenceConfig:
    """The asynchronous writers that move layer snapshots to storage."""

    writers_per_node: int = 1
    """Writer actors per node; a rank uses writer ``rank % writers_per_node`` of its node."""
    max_inflight_bytes: int = 512 * 2**20
    """Per worker: snapshot bytes handed over but not yet written; past it the worker waits (a
    stall, counted in the metrics; logged at the first wait, then at most once a minute with how
    often and how long it waited)."""
    max_versions_in_flight: int = 2
    """Versions of one layer that may be handed over and not yet committed; the policy holds a
    layer back (defers it) while it has this many, so storage that falls behind lowers the save
    rate instead of piling up snapshots. Every version handed over is written by every rank."""
    fsync: bool = True
    """fsync each file before it is committed (local and NFS stores)."""
    save_final: bool = True
    """After the last step (or a requested stop), every layer's state at that step is persisted
    like any version, so the store holds the trained model and ``export`` writes it."""
    on_staleness_breach: str = "stop"
    """What a run does when storage failures (a full or read-only disk, an object-store outage),
    or storage that does not answer (``hung_write_s``), let a layer's staleness pass the policy's
    ``smax`` plus the pipeline lag: ``stop`` (stop the workers after the current step, persist
    what it can, report the error; resume once storage is fixed) or ``warn`` (keep training, log
    the error; the metric and alert fire). Storage that is merely slow (it writes, late) is no
    breach: a warning."""
    # Default "stop": the staleness bound is what LayerCheck promises. Training on past it means
    # the next worker failure rolls back further than the operator agreed to, for as long as the
    # storage stays broken (hours, on a week-long run nobody watches at night); a stopped run
    # loses nothing and resumes with one command. "warn" is for those who watch the alert.
    hung_write_s: float = DEFAULT_HUNG_WRITE_S
    """Seconds storage may leave the oldest version handed to the writers unanswered (neither
    committed nor failed, and nothing else committed meanwhile) before it counts as storage that
    does not answer: once a layer is past ``smax`` plus the lag, that is a breach
    (``on_staleness_breach``). The default is 4 requests (a shard's directory marker, upload and
    completion, and the version's commit) each as slow as LayerCheck's S3 client allows before it
    fails (3 attempts × (3 s connect + 5 s request timeout)); a slow store commits well within it."""
    decision_timeout_s: float = 600.0
    """How long a rank waits for a step's decision, collected a step after its own report (every
    rank has reported the step by then unless one is hung: stuck outside its collectives, in a data
    loader, a callback or a hand-over). Past it the rank asks the policy actor which ranks never
    reported the step, names them in its error and fails, so the group is recovered (the hung
    rank's process ends with it) instead of stalling. Ranks that wait inside a collective are
    ended by the backend's own timeout (``init_process_group``'s ``timeout``)."""
    stop_drain_s: float = 120.0
    """On a stop (Ctrl-C, a breach): how long the driver waits for the workers to finish their
    step. At every end, stopped or not: how long after the last step the ranks wait for their last
    snapshots to be written and the writers to commit what they hold; what is not written by then
    is counted lost (storage that hangs costs this long, not until it answers)."""
    capture: bool = True
    """When a worker dies, each surviving rank hands the slices it holds of every layer at its last
    step to its writer before it exits (persisted as a partial version), and recovery takes them
    over the stored versions: under ZeRO-3 only the dead ranks' slices come back stale, under
    ZeRO-0 nothing does. Ray Train's teardown of the broken group is held back for it (below)."""
    capture_grace_s: float = 2.0
    """How long the teardown waits for a survivor to begin its capture. An NCCL survivor blocked
    in a collective is released first (its process groups aborted, docs/recovery.md "GPU and NCCL"); one that
    still never begins contributes nothing: its slices come from stored versions."""
    capture_timeout_s: float = 30.0
    """The longest the teardown of a broken group is held for the survivors' captures."""
    memory_bytes: int = 2 * 2**30
    """Per writer: bytes of shard files kept in host memory after they are written (the newest
    version of each layer's shards; past the budget the oldest steps go first, memory versions
    last), so a recovery loads them from memory and reads storage only for what no writer holds.
    0: off (recovery reads storage). Storage stays the source of truth: what is evicted is still
    recoverable from it, except memory versions (``memory_period``), which live only here.
    Beyond it a writer's process holds its runtime (about 0.3 GB: Ray's worker, torch, pyarrow)
    and its copies in flight (at most three shard files being serialised or written, and
    survivors' captures until written); the Ray object-store pages it reads the ranks' hand-overs
    from show in its RSS too, but are the node's shared object store (docs/recovery.md, "A
    writer's host memory"; the summary's ``writer host memory`` row)."""
    memory_mirror: bool = True
    """Where the cluster has more than one node, each writer also sends its shard files to a writer
    on another node, which keeps them within its own ``memory_bytes``: a lost node's shards still
    load from memory. Costs one network copy of every byte written."""
    memory_period: MemoryPeriodSetting = AUTO
    """Every this many steps each rank also hands its slices of every layer to its writer as a
    *memory version*: held in the writers' memory (and mirrored to another node), never written to
    storage. A recovery takes a lost rank's slices from the newest of those and the stored versions,
    so they come back at most ``memory_period`` steps stale whatever the storage bandwidth. Costs a
    host copy of the rank's state per period and ``memory_bytes`` room for one such version of each
    layer, of the ranks a writer serves (the stored versions' copies make room for it). A budget
    short of that is warned of at the start, with the budget needed, and each recovery's summary
    says whether every slice came back within ``memory_period`` steps. 0: off (needs
    ``memory_bytes`` > 0). ``"auto"``: chosen by the run: off where ``memory_bytes`` cannot hold a
    memory version, else every step until rank 0 has timed its first copies, then the smallest
    period at which the copy costs at most 1% of the step time (off past 100 steps); the summary's
    ``memory versions`` row names the period and why (``orchestrator/core/memory/auto_period.py``)."""
    write_budget: WriteBudgetConfig = field(default_factory=WriteBudgetConfig)
    """``[persistence.write_budget]``: the schedule's byte budget per step from the writers'
    measured drain bandwidth (headroom × bandwidth × step time, capped), so slow storage stretches
    the save periods instead of growing a queue."""

    def __post_init__(self) -> None:
        require(self.writers_per_node >= 1, "writers_per_node", ">= 1", self.writers_per_node)
        require(self.max_inflight_bytes >= 1, "max_inflight_bytes", ">= 1", self.max_inflight_bytes)
        require(self.max_versions_in_flight >= 1, "max_versions_in_flight", ">= 1", self.max_versions_in_flight)
        require(
            self.on_staleness_breach in BREACH_ACTIONS,
            "on_staleness_breach",
            " or ".join(repr(a) for a in BREACH_ACTIONS),
            self.on_staleness_breach,
        )
        require(self.hung_write_s > 0, "hung_write_s", "> 0", self.hung_write_s)
        require(self.stop_drain_s > 0, "stop_drain_s", "> 0", self.stop_drain_s)
        require(self.decision_timeout_s > 0, "decision_timeout_s", "> 0", self.decision_timeout_s)
        require(self.capture_grace_s >= 0, "capture_grace_s", ">= 0", self.capture_grace_s)
        require(self.capture_timeout_s > 0, "capture_timeout_s", "> 0", self.capture_timeout_s)
        require(self.memory_bytes >= 0, "memory_bytes", ">= 0 (0 turns the in-memory tier off)", self.memory_bytes)
        require(
            self.memory_period == AUTO or (_is_int(self.memory_period) and self.memory_period >= 0),
            "memory_period",
            '"auto" or an integer >= 0 (0 turns memory versions off)',
            self.memory_period,
        )
        require(
            self.memory_period == AUTO or not self.memory_period or self.memory_bytes > 0,
            "memory_period",
            "0 while memory_bytes is 0 (memory versions live in the writers' memory tier)",
            self.memory_period,
        )

    @property
    def memory_period_at_start(self) -> int:
        """The period a rank takes memory versions at until a decision carries the run's (the
        set one; 0 under ``"auto"``: the ranks follow the period the run chose, which the
        decisions carry from the second step of each worker group on)."""
        return 0 if self.memory_period == AUTO else int(self.memory_period)

    @property
    def capture_hand_over_s(self) -> float | None:
        """How long a survivor waits for its writer to hold its capture (``None``: capture is off)."""
        return self.capture_timeout_s if self.capture else None

    @property
    def capture_hold_s(self) -> float | None:
        """The longest Ray Train's teardown is held for captures (``None``: capture is off)."""
        return self.capture_grace_s + self.capture_timeout_s if self.capture else None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
