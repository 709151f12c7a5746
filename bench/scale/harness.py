"""One measured run of the scale harness at N simulated ranks (see the package's docstring).

The run: every rank joins the product's supervisor and hands its step-0 state over; ``warm`` steps
settle the pipeline; the measured window (``warm + 1 .. fail_after``) is where the per-step figures
come from (control actors' CPU, calls per rank, decision latency, store requests); then one rank
dies, the others capture, every rank meets at the supervisor's rendezvous, joins the next group
(the supervisor drains the writers, plans the composite and rebases the policy) and loads it; the
run goes on to ``steps`` and drains. Figures come from ``/proc`` (each actor process's CPU and
resident memory), the counting filesystem (:mod:`~layercheck.bench.scale.countfs`), the counting
handles and the timed coordinator (:mod:`~layercheck.bench.scale.instruments`), and the store."""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from layercheck.bench.scale import countfs, profile
from layercheck.bench.scale.hosts import HostConfig, RankHost
from layercheck.bench.scale.shapes import SHAPES, scaled_numel
from layercheck.orchestrator.core.persistence.config import PersistenceConfig
from layercheck.orchestrator.core.persistence.write_budget import WriteBudgetConfig
from layercheck.orchestrator.core.run_config import MetricsConfig
from layercheck.orchestrator.runtime.driver import RunHandles, start_run
from layercheck.orchestrator.runtime.names import NAMESPACE
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.policies.configs import StaggeredConfig

logger = logging.getLogger(__name__)

#: How long the run's end waits for the writers to drain (versions still unwritten then are not counted).
DRAIN_S = 180.0
#: How long the start waits for the step-0 hand-over to be written before the first step, so that
#: the measured window is the steady state, not the initial pass's backlog.
INITIAL_DRAIN_S = 900.0


@dataclass(frozen=True, kw_only=True)
class ScaleConfig:
    """One harness run. Defaults: Qwen2.5-7B's 31 layers at 1/1000 of their bytes, the product's
    default schedule (staggered, drift measured every 10th step) at a period of one layer per step,
    memory versions every 10 steps, the write budget off (a fixed schedule: per-step figures that
    compare across N), fsync off (the disk is not what is measured)."""

    ranks: int
    shape: str = "qwen2.5-7b"
    scale: int = 1000
    nodes: int = 4
    """Worker nodes the ranks are spread over (each a Ray node of the local cluster)."""
    steps: int = 24
    warm: int = 4
    fail_after: int | None = 14
    """The step after which one rank dies (``None``: no failure)."""
    step_s: float = 1.0
    period: int | None = None
    """The schedule's mean period (``None``: the number of layers, a layer per step on average)."""
    drift_every: int = 10
    memory_period: int = 10
    memory_bytes: int = 256 * 2**20
    writers_per_node: int = 1
    writer_dies_after: int | None = None
    """The step of the measured window after which the first node's writer actor is killed, with
    whatever its ranks handed it still unwritten (``None``: none is); the row's ``faults`` says how
    the run took it."""
    profile_dir: str = ""
    """Where ``py-spy`` recordings of the control actors go (the window and the recovery), summed up
    in the row's ``cpu_top``; "": none."""

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {self.shape!r}")
        if self.ranks < 2:
            raise ValueError(f"ranks must be >= 2 (one dies), got {self.ranks}")
        if self.fail_after is not None and not self.warm < self.fail_after < self.steps:
            raise ValueError(f"fail_after must lie between warm ({self.warm}) and steps ({self.steps})")
        if self.writer_dies_after is not None and not self.warm < self.writer_dies_after < (
            self.fail_after or self.steps
        ):
            raise ValueError(
                f"writer_dies_after must lie in the measured window, between warm ({self.warm}) and "
                f"{'fail_after' if self.fail_after else 'steps'} ({self.fail_after or self.steps})"
            )


@dataclass(kw_only=True)
class ScaleRow:
    """The figures of one N (``scale.json``'s ``rows``)."""

    n_ranks: int
    layers: int
    window_steps: int
    actor_cpu_ms_per_step: dict[str, float]
    """Per control actor (``policy``, ``supervisor``, ``writers`` summed), CPU ms per measured step."""
    control_cpu_ms_per_step: float
    """The policy actor's and the supervisor's together: the control plane's CPU per step."""
    host_cpu_ms_per_rank_step: float
    """The rank side's CPU (the hosts' processes) per rank and step: the protocol's cost on a rank."""
    calls_per_rank_per_step: dict[str, float]
    """By ``actor.method``, the calls a rank makes per step, and ``receipts`` (writer → supervisor per shard)."""
    decision_latency_ms: dict[str, float]
    waited_ms_per_step: float
    """The training thread's time in the decision calls, per rank and step: how long a rank waited on the control plane."""
    commit_latency_ms: dict[str, float]
    """From the hand-over (the step's start: the ranks compute nothing) to the commit record's time."""
    steps_late_s: float
    """How far the slowest host fell behind the step schedule by the window's end (the machine's limit)."""
    plan_s: float | None
    """The supervisor's recovery plan, manifest read included: from the loss's detection to the
    composite planned, the writers' drain first (:attr:`drain_s`)."""
    recovery_s: dict[str, float]
    versions: int
    store_requests_per_step: dict[str, float]
    store_requests_recovery: dict[str, int]
    writer_rss_bytes: int
    """The largest writer process's resident memory at the end."""
    cpu_top: dict[str, Any] = field(default_factory=dict)
    """With ``profile_dir``: per phase and actor, the functions that held the CPU most (``profile.py``)."""
    drain_s: float | None = None
    """Of :attr:`plan_s`, the writers' drain: what the lost group handed over, written before the plan.
    It measures the writers' backlog, so storage and this machine's cores, not the plan."""
    faults: dict[str, Any] = field(default_factory=dict)
    """With ``writer_dies_after``: the writer killed, how many snapshots it had not written then,
    and what the run made of it (writers replaced, versions lost) at the end."""
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ---- /proc ----------------------------------------------------------------------------------
_last_cpu_s: dict[int, float] = {}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (of a process gone since: when last read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return _last_cpu_s.get(pid, 0.0)
    _last_cpu_s[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return _last_cpu_s[pid]


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (0 if it is gone: a writer the recovery replaced)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _pid(actor: Any) -> int:
    return int(ray.get(actor.__ray_call__.remote(lambda self: os.getpid())))


def _store_counts(actor: Any) -> dict[str, int]:
    return dict(ray.get(actor.__ray_call__.remote(lambda self: countfs.snapshot())))


def _sum_counts(counts: list[dict[str, int]]) -> dict[str, int]:
    return {kind: sum(c.get(kind, 0) for c in counts) for kind in countfs.KINDS}


def _minus(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {"median": float("nan"), "p99": float("nan"), "n": 0}
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"median": 1000 * statistics.median(ordered), "p99": 1000 * p99, "n": len(ordered)}


# ---- the run --------------------------------------------------------------------------------
class _Run:
    """The actors of one harness run, and what it measures of them."""

    def __init__(self, config: ScaleConfig, work_dir: Path, worker_nodes: list[str]) -> None:
        self.config = config
        self.numel = scaled_numel(SHAPES[config.shape], config.scale)
        self.storage_uri = str(work_dir / f"store-n{config.ranks}")
        period = config.period or len(self.numel)
        self.handles: RunHandles = start_run(
            name=f"scale-n{config.ranks}",
            storage_uri=self.storage_uri,
            policy=StaggeredConfig(period=period, drift_every=config.drift_every),
            persistence=PersistenceConfig(
                fsync=False,
                writers_per_node=config.writers_per_node,
                memory_bytes=config.memory_bytes,
                memory_period=config.memory_period,
                write_budget=WriteBudgetConfig(enabled=False),
            ),
            metrics=MetricsConfig(port=0, discovery_dir=""),
            num_workers=config.ranks,
            layer_numel=self.numel,
            in_place=True,
            # the ranks are protocols, not Ray workers; as Ray Train would place them, a node (1 CPU
            # each here) holds its share, which sizes a writer's share of a memory version
            worker_resources={"CPU": len(worker_nodes) / config.ranks},
        )
        host_config = HostConfig(
            world_size=config.ranks,
            numel=self.numel,
            drift_every=config.drift_every,
            storage_uri=self.storage_uri,
            max_inflight_bytes=PersistenceConfig().max_inflight_bytes,
            memory_period=config.memory_period,
        )
        per_node = -(-config.ranks // len(worker_nodes))
        self.hosts = []
        for index, node in enumerate(worker_nodes):
            ranks = list(range(index * per_node, min(config.ranks, (index + 1) * per_node)))
            if ranks:
                here = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
                self.hosts.append(
                    RankHost.options(scheduling_strategy=here, namespace=NAMESPACE).remote(  # type: ignore[attr-defined]
                        ranks, host_config, self.handles.policy, self.handles.supervisor
                    )
                )
        self.worker_nodes = worker_nodes
        self._counts: dict[int, dict[str, int]] = {}
        """Each actor process's store requests when last asked, by pid."""

    @property
    def supervisor(self) -> Any:
        return self.handles.supervisor

    def writers(self) -> list[Any]:
        return [w for node in self.worker_nodes for w in ray.get(self.supervisor.writers_for.remote(node))]

    def control_pids(self) -> dict[str, list[int]]:
        return {
            "policy": [_pid(self.handles.policy)],
            "supervisor": [_pid(self.supervisor)],
            "writers": [_pid(w) for w in self.writers()],
            "hosts": [int(p) for p in ray.get([h.pid.remote() for h in self.hosts])],
        }

    def receipts(self) -> int:
        """Shards the writers wrote or hold so far: each is one receipt to the supervisor."""
        return sum(s.written_versions + s.memory_versions for s in ray.get(self.supervisor.writer_stats.remote()))

    def store_counts(self) -> dict[str, int]:
        """Every process's store requests so far; a writer the recovery replaced counts with what
        it had made when last asked (its requests since are not counted)."""
        for actor in [self.supervisor, *self.writers()]:
            self._counts[_pid(actor)] = _store_counts(actor)
        host_counts = list(ray.get([h.store_counts.remote() for h in self.hosts]))
        return _sum_counts(list(self._counts.values()) + host_counts)

    def steps(self, first: int, last: int) -> list[dict[str, Any]]:
        start_at = time.time() + 0.5  # (every host has its call by then)
        self.step_due.update({s: start_at + (s - first) * self.config.step_s for s in range(first, last + 1)})
        return list(ray.get([h.run_steps.remote(first, last, start_at, self.config.step_s) for h in self.hosts]))

    step_due: dict[int, float] = {}

    def kill(self) -> None:
        for actor in [*self.hosts, *self.writers(), self.handles.policy, self.supervisor]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as error:  # noqa: BLE001 - gone already
                logger.debug("kill: %s", error)


def run_scale(config: ScaleConfig, work_dir: Path, worker_nodes: list[str]) -> ScaleRow:
    """One run at ``config.ranks`` ranks on the connected cluster's ``worker_nodes``."""
    run = _Run(config, work_dir, worker_nodes)
    run.step_due = {}
    notes: list[str] = []
    try:
        return _measure(run, config, notes)
    finally:
        run.kill()


def _measure(run: _Run, config: ScaleConfig, notes: list[str]) -> ScaleRow:
    n = config.ranks
    ray.get([h.join.remote(1) for h in run.hosts])
    ray.get([h.hand_over_initial.remote() for h in run.hosts])
    initial_started = time.monotonic()
    drained = [w.drain.remote() for w in run.writers()]
    _, undrained = ray.wait(drained, num_returns=len(drained), timeout=INITIAL_DRAIN_S)
    if undrained:
        notes.append(f"the step-0 hand-over was not written within {INITIAL_DRAIN_S:g}s")
    notes.append(f"step-0 hand-over written in {time.monotonic() - initial_started:.1f}s")
    fail_after = config.fail_after or config.steps
    run.steps(1, config.warm)
    ray.get([h.take_measures.remote() for h in run.hosts])  # (the warm steps' calls and latencies: dropped)
    pids = run.control_pids()
    cpu_top: dict[str, Any] = {}
    profiled = {"policy": pids["policy"][0], "supervisor": pids["supervisor"][0], "writer": pids["writers"][0]}
    recording = profile.record(profiled, Path(config.profile_dir), f"n{n}-window") if config.profile_dir else []
    cpu_before = {role: sum(cpu_s(p) for p in ps) for role, ps in pids.items()}
    store_before = run.store_counts()
    receipts_before = run.receipts()
    faults: dict[str, Any] = {}
    if config.writer_dies_after is None:
        window = run.steps(config.warm + 1, fail_after)
    else:  # the window in two, the first node's writer killed between them with its queue
        window = run.steps(config.warm + 1, config.writer_dies_after)
        faults = _kill_writer(run)
        window = _joined_windows(window, run.steps(config.writer_dies_after + 1, fail_after))
        faults["replaced_by_window_end"] = ray.get(run.supervisor.status.remote()).writers_replaced
    cpu = {role: sum(cpu_s(p) for p in ps) - cpu_before[role] for role, ps in pids.items()}
    store_window = _minus(run.store_counts(), store_before)
    measures = ray.get([h.take_measures.remote() for h in run.hosts])
    cpu_top["window"] = profile.summarize(recording)
    window_steps = fail_after - config.warm
    calls: dict[str, int] = {"receipts": run.receipts() - receipts_before}  # writer -> supervisor, one per shard
    for m in measures:
        for key, count in m["calls"].items():
            calls[key] = calls.get(key, 0) + count
    latencies = [x for m in measures for x in m["latencies"]]
    waited = sum(sum(w["waited_s"].values()) for w in window)
    late = max(w["late_s"][-1] for w in window)
    host_cpu = sum(w["cpu_s"] for w in window)

    recovery: dict[str, float] = {}
    plan_s = drain_s = None
    store_recovery: dict[str, int] = {}
    if config.fail_after is not None:
        store_before = run.store_counts()
        recording = profile.record(profiled, Path(config.profile_dir), f"n{n}-recovery") if config.profile_dir else []
        dead = n // 2
        started = time.monotonic()
        failed = ray.get([h.fail.remote(dead) for h in run.hosts])
        captured = time.monotonic()
        joined = ray.get([h.join.remote(2, regroup=True) for h in run.hosts])
        resumed = time.monotonic()
        cpu_top["recovery"] = profile.summarize(recording)
        store_recovery = _minus(run.store_counts(), store_before)
        recovery = {
            "capture_s": captured - started,
            "rendezvous_s": max(j["rendezvous_s"] for j in joined),
            "join_s": max(j["join_s"] for j in joined),
            "load_s": max(j["load_s"] for j in joined),
            "rank_load_s_max": max((x for j in joined for x in j["rank_load_s"]), default=0.0),
            "death_to_resume_s": resumed - started,
            "host_capture_s": max(f["capture_s"] for f in failed),
        }
        status = ray.get(run.supervisor.status.remote())
        recoveries = status.account["recoveries"]
        plan_s = recoveries[-1]["plan_s"] if recoveries else None
        drain_s = recoveries[-1]["drain_s"] if recoveries else None
        start_step = min(j["start_step"] for j in joined)
        if start_step != fail_after + 1:
            notes.append(f"resumed at step {start_step}, not {fail_after + 1}")
        run.steps(start_step, config.steps)
    finished = ray.get([h.finish.remote() for h in run.hosts])
    ray.get(run.supervisor.drain.remote(DRAIN_S))
    writer_pids = [_pid(w) for w in run.writers()]  # (the writers there are now: a recovery's drain may replace some)
    writer_rss = max((rss_bytes(p) for p in writer_pids), default=0)
    if replaced := len(set(pids["writers"]) - set(writer_pids)):
        notes.append(f"{replaced} writer(s) replaced (killed: faults; or found still writing by the recovery's drain)")
    store = LayerStore.open(run.storage_uri, fsync=False)
    records = store.versions()
    # a version's step is the step whose after_step handed it over (the decision of the step before)
    commit_latency = [
        r.committed_at - run.step_due[r.step]
        for r in records
        if not r.partial and config.warm < r.step <= fail_after and r.step in run.step_due
    ]
    status = ray.get(run.supervisor.status.remote())
    del finished
    if faults:
        faults.update(writers_replaced=status.writers_replaced, lost_versions=status.lost_versions)
    per_rank_step = n * window_steps
    control = cpu["policy"] + cpu["supervisor"]
    return ScaleRow(
        n_ranks=n,
        layers=len(run.numel),
        window_steps=window_steps,
        actor_cpu_ms_per_step={role: 1000 * cpu[role] / window_steps for role in ("policy", "supervisor", "writers")},
        control_cpu_ms_per_step=1000 * control / window_steps,
        host_cpu_ms_per_rank_step=1000 * host_cpu / per_rank_step,
        calls_per_rank_per_step={key: count / per_rank_step for key, count in sorted(calls.items())},
        decision_latency_ms=percentiles_ms(latencies),
        waited_ms_per_step=1000 * waited / per_rank_step,
        commit_latency_ms=percentiles_ms(commit_latency),
        steps_late_s=late,
        plan_s=plan_s,
        drain_s=drain_s,
        recovery_s=recovery,
        versions=len(records),
        store_requests_per_step={k: v / window_steps for k, v in store_window.items()},
        store_requests_recovery=store_recovery,
        writer_rss_bytes=writer_rss,
        cpu_top={phase: top for phase, top in cpu_top.items() if top},
        faults=faults,
        notes=notes + [f"state {status.state}"],
    )


def _kill_writer(run: _Run) -> dict[str, Any]:
    """Kill the first worker node's writer actor (as its process dying would) and say what it had
    not written: its ranks find it dead at their next hand-over and give a new one what they hold."""
    writer = ray.get(run.supervisor.writers_for.remote(run.worker_nodes[0]))[0]
    stats = ray.get(writer.get_stats.remote())
    cpu_s(_pid(writer))  # (its CPU until now still counts in the window's)
    ray.kill(writer, no_restart=True)
    return {"writer_killed": stats.name, "queued_then": stats.queued}


def _joined_windows(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each host's figures over two spans of steps as over one (``RankHost.run_steps``' dicts; the
    ranks' waits and stalls are running totals: the second span's)."""
    return [
        {
            **b,
            "busy_s": a["busy_s"] + b["busy_s"],
            "late_s": a["late_s"] + b["late_s"],
            "cpu_s": a["cpu_s"] + b["cpu_s"],
        }
        for a, b in zip(first, second, strict=True)
    ]


# ---- the cluster ----------------------------------------------------------------------------
@dataclass
class LocalCluster:
    """A multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``): a head node for the
    driver and the control actors (as ``layercheck train`` places them), and worker nodes for the
    ranks and their writers. Each node is a raylet and an object store of its own."""

    nodes: int
    object_store_bytes: int = 512 * 2**20
    cluster: Any = None
    worker_nodes: list[str] = field(default_factory=list)
    tmp: str = ""
    _ray_tmpdir: str | None = None

    def start(self) -> LocalCluster:
        from ray.cluster_utils import Cluster

        self.tmp = tempfile.mkdtemp(prefix="lcscale-", dir="/tmp")  # Ray's socket paths must stay short
        self._ray_tmpdir = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = self.tmp
        head = {"num_cpus": 1, "object_store_memory": self.object_store_bytes, "include_dashboard": False}
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        workers = [
            self.cluster.add_node(num_cpus=1, object_store_memory=self.object_store_bytes) for _ in range(self.nodes)
        ]
        self.cluster.wait_for_nodes()
        countfs.install()
        ray.init(
            address=self.cluster.address,
            namespace=NAMESPACE,
            runtime_env={"worker_process_setup_hook": "layercheck.bench.scale.countfs.install"},
            log_to_driver=False,
        )
        self.worker_nodes = [node.node_id for node in workers]
        return self

    def stop(self) -> None:
        ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
        countfs.uninstall()  # this process opens stores as the product does again
        if self._ray_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = self._ray_tmpdir
