"""The driver of a training run: connect to (or start) Ray, start the run's actors, run the
``TorchTrainer`` with Ray Train's failure handling, show progress, and summarise.

:func:`train` runs the built-in loop; ``layercheck.LayerCheckTrainer`` runs a user's own
``train_loop_per_worker``. Both go through the same three steps: :func:`start_run` (policy
actor, supervisor with its writer pool, metrics), ``fit_watch.fit_watched`` (the trainer's ``fit``
with progress polling, Ctrl-C and SIGTERM) and :func:`finish_run` (drain, final state, drift
trace, result).

One file because it is one run's life on the driver: those steps hand each other the run's actors
and handles, and each helper below serves one of them (the watched ``fit`` already lives apart).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from layercheck.orchestrator.core.memory.auto_period import AUTO, PeriodTimer, starting_period
from layercheck.orchestrator.core.memory.budget import (
    memory_version_need,
    most_ranks_on_a_node,
    ranks_per_writer,
    warn_if_unkept,
)
from layercheck.orchestrator.core.persistence.config import PersistenceConfig
from layercheck.orchestrator.core.persistence.staleness_guard import StalenessLimits
from layercheck.orchestrator.core.run_config import MetricsConfig, RunConfig
from layercheck.orchestrator.core.run_start import StartOptions, check_config, open_run_store
from layercheck.orchestrator.core.run_status import RunStatus
from layercheck.orchestrator.runtime.cluster import alive_nodes, check_shared_storage, connect, node_resources
from layercheck.orchestrator.runtime.fit_watch import ProgressHook, RunHandles, fit_watched, supervisor_gone
from layercheck.orchestrator.runtime.handles import PolicyHandle, SupervisorHandle, kill
from layercheck.orchestrator.runtime.metrics_discovery import bind_host, remove_discovery, write_discovery
from layercheck.orchestrator.runtime.names import NAMESPACE, RunNames
from layercheck.orchestrator.runtime.policy_actor import MAX_RESTARTS, PolicyActor
from layercheck.orchestrator.runtime.supervisor_actor import SupervisorActor, supervisor_threads
from layercheck.orchestrator.runtime.supervisor_loss import supervisor_died
from layercheck.orchestrator.runtime.train_report import with_callbacks
from layercheck.orchestrator.store.layer_store import DRIFT_TRACE_FILE, LayerStore
from layercheck.orchestrator.store.lease import LEASE_LOST, StoreLease, stopped_for_the_lease
from layercheck.orchestrator.store.recovery_source import stored_at
from layercheck.policies.configs import PolicyConfig
from layercheck.policies.trace import DriftTrace

logger = logging.getLogger(__name__)

#: Seconds the driver's calls to the run's actors at the end may take beyond their own bounds.
ANSWER_S = 60.0


@dataclass
class RunResult:
    run_id: str
    config: RunConfig | None
    """The built-in loop's run config; ``None`` for a user's own loop (``layercheck.LayerCheckTrainer``)."""
    status: dict[str, Any]
    """The supervisor's final view (``RunStatus.as_dict``), with what the writers hold in memory
    (``"memory"``) and what the store holds (``"stored"``). JSON, as users' code reads it."""
    trace: DriftTrace
    """The run's drift trace: per step, the learning rate and every layer's drift."""
    layer_numel: dict[str, int]
    error: str | None = None
    metrics_url: str | None = None
    """Where the run's Prometheus metrics were served (while the run was live); ``None``: disabled."""
    storage_uri: str = ""
    """Where the run's checkpoints are (the config's storage when empty)."""
    policy: PolicyConfig | None = None
    """The checkpoint policy the run used (the config's when ``None``)."""
    interrupted: bool = False
    """Stopped by Ctrl-C (SIGINT) on the driver: resume it with ``--resume``."""
    train_reports: list[dict[str, object]] = field(default_factory=list)
    """Rank 0's metrics of each ``ray.train.report`` (step, loss, max_staleness, ettr; built-in
    loop, Train v2), as Ray Train's controller received them, oldest first."""
    end_errors: list[str] = field(default_factory=list)
    """What failed in the driver's end-of-run work (drain, drift trace, final status): logged and
    shown in the summary, never raised, so the summary is always printed."""
    schedule: dict[str, object] = field(default_factory=dict)
    """The policy actor's :meth:`~layercheck.orchestrator.runtime.policy_actor.PolicyActor.schedule_view`
    at the end: peak bytes per step, the write budget and the drain bandwidth (empty if unread)."""
    supervisor_lost: str = ""
    """Why the run's supervisor died ("": it did not): the run ended with it, and its store
    resumes (``layercheck train`` prints the command)."""
    memory_period: int = 0
    """``persistence.memory_period`` of the run at its start (the config's when it has one; under
    ``"auto"`` the supervisor's status has the period chosen): the staleness its recoveries
    promised (0: no memory versions)."""

    def __post_init__(self) -> None:
        if self.config is not None:
            self.memory_period = self.memory_period or self.config.persistence.memory_period_at_start
            self.storage_uri = self.storage_uri or self.config.storage_uri
            self.policy = self.policy if self.policy is not None else self.config.policy


def train(
    config: RunConfig,
    *,
    overwrite: bool = False,
    resume: bool = False,
    take_over: bool = False,
    on_progress: ProgressHook | None = None,
    poll_s: float = 1.0,
) -> RunResult:
    """Run the training job ``config`` describes to the end; never raises for a failed run
    (see ``RunResult.error``), only for a bad setup. ``resume`` continues the run already in
    the storage from its newest recoverable step, at whatever world size ``config`` asks for."""
    from ray.train import FailureConfig, ScalingConfig
    from ray.train import RunConfig as TrainRunConfig

    # (imported here: the train function, Ray Train's trainers and in-place recovery import torch,
    # 1.2-1.3 s that `layercheck` commands which start no run never pay)
    from layercheck.orchestrator.runtime.train_fn import train_fn

    config = config.with_absolute_storage()
    # config checks, the store's read-only checks, the cluster (is the storage shared by its
    # nodes?), then the store's lease, overwrite, run.json: nothing is written before
    options = StartOptions(overwrite=overwrite, resume=resume, take_over=take_over)  # before Ray starts
    layer_numel = check_config(config)

    def join_the_cluster() -> None:  # after the read-only store checks, before the lease
        connect(config)
        check_shared_storage(config.storage_uri, shared=config.cluster.shared_storage)

    lease = open_run_store(config, options, layer_numel=layer_numel, before_write=join_the_cluster)
    try:
        handles = start_run(
            name=config.name,
            storage_uri=config.storage_uri,
            policy=config.policy,
            persistence=config.persistence,
            metrics=config.metrics,
            num_workers=config.cluster.num_workers,
            layer_numel=layer_numel,
            resume=resume,
            lease=lease,
            in_place=config.cluster.in_place,
            spares=config.cluster.spares,
            worker_resources={"CPU": config.cluster.cpus_per_worker, "GPU": 1.0 if config.cluster.use_gpu else 0.0},
        )
        scratch = tempfile.mkdtemp(prefix="layercheck-raytrain-")
        try:
            run_config = TrainRunConfig(
                name=handles.run_id,
                storage_path=scratch,
                failure_config=FailureConfig(max_failures=config.cluster.max_failures),
            )
            trainer = _trainer_class(config)(
                train_fn,
                train_loop_config={"run": config.to_json(), "run_id": handles.run_id},
                scaling_config=ScalingConfig(
                    # Train v2's ScalingConfig (ray.train's when RAY_TRAIN_V2_ENABLED) takes (min, max);
                    # mypy sees v1's, which ray.train binds first
                    num_workers=_group_size(config),  # type: ignore[arg-type]
                    use_gpu=config.cluster.use_gpu,
                    resources_per_worker={"CPU": config.cluster.cpus_per_worker},
                    **_elastic_options(config),
                ),
                run_config=with_callbacks(
                    run_config, handles.supervisor, config.persistence, in_place=config.cluster.in_place
                ),
            )
            error = fit_watched(
                handles, trainer, on_progress=on_progress, poll_s=poll_s, fault_note=_fault_note(config)
            )
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return finish_run(handles, error=error, config=config)
    finally:
        # also when setup fails after the lease was taken; a renewal hung on storage is not waited for
        lease.release(wait_s=config.persistence.stop_drain_s)


def _trainer_class(config: RunConfig) -> type:
    """``cluster.in_place``: the trainer under which Ray Train replaces only a lost worker."""
    if not config.cluster.in_place:  # (imported here: torch, as train_fn in train)
        from layercheck.orchestrator.runtime.ray_trainer import LayerCheckTorchTrainer

        return LayerCheckTorchTrainer
    from layercheck.orchestrator.runtime.in_place import InPlaceTorchTrainer

    return InPlaceTorchTrainer


def start_run(
    *,
    name: str,
    storage_uri: str,
    policy: PolicyConfig,
    persistence: PersistenceConfig,
    metrics: MetricsConfig,
    num_workers: int,
    layer_numel: dict[str, int],
    resume: bool = False,
    lease: StoreLease | None = None,
    in_place: bool = False,
    spares: int = 0,
    worker_resources: Mapping[str, float] | None = None,
) -> RunHandles:
    """Start one run's policy actor, supervisor (which starts the writer pool on demand) and
    metrics exporter, named after a fresh run id. Ray must be connected. ``lease``: the driver's lease
    on the store; commits are fenced by it, and the run stops once it is lost. ``in_place``: the
    run asked for in-place recovery (``cluster.in_place``): a full restart then says why it ran.
    ``spares``: warm spares beside the ``num_workers`` training ranks (``cluster.spares``).
    ``worker_resources``: what each worker asks of Ray (``{"CPU": 1}``, ``{"GPU": 1}``): how many
    ranks one node can hold, so one writer's share of a memory version (``None``: all on one node)."""
    run_id = f"{name}-{uuid.uuid4().hex[:8]}"
    names = RunNames(run_id)
    memory_period = _memory_period(persistence, layer_numel, num_workers, worker_resources or {})
    # the run's control actors live with the driver (the head node under `ray job submit`): a lost
    # worker node must not take the supervisor, the policy or the metrics exporter with it
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    # both are @ray.remote classes, which mypy types as the class itself (python/mypy#3135): the
    # ignores below are for Ray's ActorClass.options. The policy actor is rebuilt when its process
    # dies (the group it served is recovered: policy_actor.py); the supervisor is not: its loss
    # ends the run (fit_watch.py)
    policy_actor: PolicyHandle = PolicyActor.options(  # type: ignore[attr-defined]
        name=names.policy, namespace=NAMESPACE, scheduling_strategy=here, max_restarts=MAX_RESTARTS
    ).remote(
        policy,
        layer_numel,
        num_workers,
        persistence.max_versions_in_flight,
        persistence.write_budget,
        # "auto": the decisions carry the period to the ranks (set ones: each rank has it from the config)
        memory_period.current.period if memory_period.current.auto else None,
    )
    supervisor: SupervisorHandle = SupervisorActor.options(  # type: ignore[attr-defined]
        name=names.supervisor,
        namespace=NAMESPACE,
        scheduling_strategy=here,
        max_concurrency=supervisor_threads(num_workers + spares),
    ).remote(
        run_id=run_id,
        store_uri=storage_uri,
        fsync=persistence.fsync,
        writers_per_node=persistence.writers_per_node,
        layer_numel=layer_numel,
        policy_actor=policy_actor,
        resume=resume,
        limits=StalenessLimits.of(
            policy, on_breach=persistence.on_staleness_breach, hung_write_s=persistence.hung_write_s
        ),
        capture_grace_s=persistence.capture_grace_s,
        capture_timeout_s=persistence.capture_timeout_s,
        memory_bytes=persistence.memory_bytes,
        memory_mirror=persistence.memory_mirror,
        lease_epoch=lease.epoch.epoch if lease is not None else None,
        in_place=in_place,
        spares=(num_workers, spares) if spares else None,
        lease_valid_until=lease.valid_until if lease is not None else None,
        memory_period=memory_period,
    )
    ray.get(supervisor.status.remote())  # fail here, not in the workers, if it cannot start
    if lease is not None:  # found lost by its renewal: stop at once, before the next commit finds out
        lease.on_lost = functools.partial(_stop_for_the_lease, supervisor)
        # each renewal that reached the store moves the writers' and the commits' deadline on
        lease.on_renewed = functools.partial(_lease_renewed, supervisor)
    metrics_url, discovery_file = _start_metrics(supervisor, metrics, run_id)
    return RunHandles(
        run_id=run_id,
        storage_uri=storage_uri,
        policy_config=policy,
        layer_numel=dict(layer_numel),
        policy=policy_actor,
        supervisor=supervisor,
        metrics_url=metrics_url,
        discovery_file=discovery_file,
        stop_drain_s=persistence.stop_drain_s,
        lease=lease,
        memory_period=memory_period.current.period,
        stall_after_s=persistence.decision_timeout_s,
    )


def _memory_period(
    persistence: PersistenceConfig,
    layer_numel: dict[str, int],
    num_workers: int,
    worker_resources: Mapping[str, float],
) -> PeriodTimer:
    """The run's memory-version period at its start (``core/memory/auto_period.py``), and for
    ``"auto"`` the supervisor's timer that chooses it. A set period whose ``persistence.memory_bytes``
    cannot hold a whole memory version of the ranks one writer serves (``core/memory/budget.py``)
    is warned of: it would not be kept; ``"auto"`` is off then, and says so. The ranks one writer
    serves: as many as the largest node fits, each asking ``worker_resources``."""
    setting = persistence.memory_period
    nodes = node_resources()
    per_node = most_ranks_on_a_node(num_workers, worker_resources, nodes)
    mirrored = persistence.memory_mirror and setting != 0 and len(nodes) > 1
    ranks = ranks_per_writer(num_workers, persistence.writers_per_node, mirrored=mirrored, per_node=per_node)
    if setting != AUTO:
        warn_if_unkept(
            layer_numel,
            memory_period=int(setting),
            memory_bytes=persistence.memory_bytes,
            world_size=num_workers,
            ranks=ranks,
        )
    need = memory_version_need(layer_numel, world_size=num_workers, ranks=ranks)
    start = starting_period(setting, need=need, memory_bytes=persistence.memory_bytes)
    logger.info("memory versions: %s", start.why)
    return PeriodTimer(start, need=need, memory_bytes=persistence.memory_bytes)


def finish_run(handles: RunHandles, *, error: str | None, config: RunConfig | None = None) -> RunResult:
    """Let the writers finish, record the final state and the drift trace, stop the actors.
    Never raises: what fails here is logged and listed in ``RunResult.end_errors``. A supervisor
    that died ends the run with its one-line reason (``supervisor_loss.py``), in place of the
    error Ray Train raised for it; what is known then comes from the driver's last poll, the
    policy actor and the store."""
    supervisor, policy = handles.supervisor, handles.policy
    end_errors: list[str] = []
    if not handles.supervisor_lost and _supervisor_died(supervisor):
        supervisor_gone(handles)
    lost = handles.supervisor_lost
    last: RunStatus | None
    if lost:
        error = lost
        last = dataclasses.replace(handles.last_status, state="failed") if handles.last_status is not None else None
    else:
        last, error = _end_with_the_supervisor(supervisor, handles.stop_drain_s, error, end_errors)
    drain_s = handles.stop_drain_s
    trace = DriftTrace.from_json(
        {"steps": [], "layers": [{"name": name, "numel": numel} for name, numel in handles.layer_numel.items()]}
    )
    trace = _at_end(
        "collecting the drift trace", end_errors, lambda: _drift_trace(policy, handles.layer_numel), default=trace
    )
    if stopped_for_the_lease(last.stop_reason if last is not None else None) or _lapsed(
        handles.lease
    ):  # (maybe) another run's now
        logger.warning("not writing %s: this run no longer holds its store's lease", DRIFT_TRACE_FILE)
    else:
        _at_end(
            f"writing {DRIFT_TRACE_FILE}",
            end_errors,
            lambda: LayerStore.open(handles.storage_uri).fs.write_bytes(
                DRIFT_TRACE_FILE, json.dumps(trace.to_json()).encode()
            ),
            timeout_s=drain_s,
        )
    schedule = _at_end(
        "reading the schedule's figures",
        end_errors,
        lambda: ray.get(policy.schedule_view.remote(), timeout=60),
        default={},
    )
    final, memory = (last, {}) if lost else _final_status(supervisor, last, end_errors)
    step = final.step if final is not None else 0
    stored = _at_end(
        "reading what the store holds",
        end_errors,
        lambda: stored_at(LayerStore.open(handles.storage_uri), handles.layer_numel, step),
        timeout_s=drain_s,
    )
    status = final.as_dict() if final is not None else {}
    status |= {"memory": memory} if memory else {}
    status |= {"stored": stored} if stored else {}
    train_reports = (
        []
        if lost
        else _at_end(
            "reading the Ray Train reports",
            end_errors,
            lambda: ray.get(supervisor.train_reports.remote(), timeout=60),
            default=[],
        )
    )
    result = RunResult(
        run_id=handles.run_id,
        config=config,
        status=status,
        trace=trace,
        layer_numel=handles.layer_numel,
        error=error,
        metrics_url=handles.metrics_url,
        storage_uri=handles.storage_uri,
        policy=handles.policy_config,
        interrupted=handles.interrupted,
        train_reports=train_reports,
        end_errors=end_errors,
        schedule=schedule,
        supervisor_lost=lost,
        memory_period=handles.memory_period,
    )
    if handles.metrics_url is not None and not lost:  # the final values reach Prometheus before the exporter ends
        _at_end("flushing the metrics", end_errors, lambda: ray.get(supervisor.flush_metrics.remote(), timeout=120))
    remove_discovery(handles.discovery_file)  # the exporter ends with the supervisor: stop pointing at it
    for actor in (supervisor, policy):
        _at_end("stopping the run's actors", end_errors, functools.partial(kill, actor))
    return result


def _stop_for_the_lease(supervisor: SupervisorHandle, reason: str) -> None:
    supervisor.request_stop.remote(f"{LEASE_LOST} ({reason})")  # no wait: the lease's renewal thread calls it


def _lease_renewed(supervisor: SupervisorHandle, valid_until: float) -> None:
    supervisor.lease_renewed.remote(valid_until)  # no wait: as above


def _drift_trace(policy: PolicyHandle, layer_numel: Mapping[str, int]) -> DriftTrace:
    """The run's drift trace, from the policy actor, with the layers' sizes."""
    steps = ray.get(policy.trace.remote(), timeout=60)
    return DriftTrace.from_json(
        {**steps, "layers": [{"name": name, "numel": numel} for name, numel in layer_numel.items()]}
    )


def _supervisor_died(supervisor: SupervisorHandle) -> bool:
    """Whether the run's supervisor is dead for good (a call to it says so)."""
    try:
        ray.get(supervisor.status.remote(), timeout=60)
    except Exception as error:  # noqa: BLE001 - only its death counts: the end's own calls say the rest
        return supervisor_died(error)
    return False


def _end_with_the_supervisor(
    supervisor: SupervisorHandle, drain_s: float, error: str | None, end_errors: list[str]
) -> tuple[RunStatus | None, str | None]:
    """The supervisor's part of the end: the final drain, its status, and the end recorded; the
    status and the run's error (a setup error or a stop's reason where the trainer raised none)."""
    # persistence.stop_drain_s after the last step, also for a run that ended by itself: the ranks'
    # final hand-over waits within the same bound, and what the writers have not written by then is
    # counted lost, so storage that hangs costs that long and not until it answers (the timeout
    # here only guards against a supervisor that does not answer at all)
    _at_end(
        "draining the writers",
        end_errors,
        lambda: ray.get(supervisor.drain.remote(drain_s), timeout=drain_s + ANSWER_S),
    )
    status: RunStatus | None = _at_end(
        "reading the run's status", end_errors, lambda: ray.get(supervisor.status.remote(), timeout=60)
    )
    if status is not None and status.setup_error:  # the trainer's error wraps it in Ray Train's ControllerError
        error = status.setup_error
    if error is None and status is not None and status.stop_reason:
        error = f"stopped after step {status.step}: {status.stop_reason}"
    _at_end(
        "recording the end of the run",
        end_errors,
        lambda: ray.get(supervisor.finish.remote(error is None, error or ""), timeout=60),
    )
    return status, error


def _final_status(
    supervisor: SupervisorHandle, status: RunStatus | None, end_errors: list[str]
) -> tuple[RunStatus | None, dict[str, object]]:
    """The supervisor's status after the end was recorded, and what the writers hold in memory."""
    final: RunStatus | None = _at_end(
        "reading the run's final status",
        end_errors,
        lambda: ray.get(supervisor.status.remote(), timeout=60),
        default=status,
    )
    memory = _at_end(
        "reading what the writers hold in memory",
        end_errors,
        lambda: ray.get(supervisor.memory_view.remote(), timeout=60),
        default={},
    )
    return final, memory


def _at_end(
    what: str, errors: list[str], fn: Callable[[], Any], default: Any = None, *, timeout_s: float | None = None
) -> Any:
    """``fn()``, or — if it raises — ``default``, with the error logged and listed in ``errors``.
    ``timeout_s``: ``fn`` reads or writes the store, which may hang past any client timeout (an NFS
    mount that stopped answering): it runs in a thread of its own, and after ``timeout_s`` the
    driver goes on without it (``default``, listed as an error; the thread ends with the process)."""
    started = time.monotonic()
    try:
        return fn() if timeout_s is None else _within(fn, timeout_s)
    except Exception as error:  # noqa: BLE001 - the driver's end must always reach the summary
        message = f"{what} failed after {time.monotonic() - started:.1f}s: {type(error).__name__}: {error}"
        logger.error("%s", message)
        errors.append(message)
        return default


def _within(fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()`` in a daemon thread, waited for at most ``timeout_s``: :class:`TimeoutError` after that."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - carried to the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="layercheck-end-io", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"storage did not answer within {timeout_s:g}s (persistence.stop_drain_s)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _lapsed(lease: StoreLease | None) -> bool:
    """The driver's own lease has expired without a renewal reaching the store."""
    return lease is not None and lease.valid_until <= time.time()


def _start_metrics(supervisor: SupervisorHandle, metrics: MetricsConfig, run_id: str) -> tuple[str | None, str | None]:
    """Start the run's Prometheus exporter in the supervisor (``metrics.port = 0``: none) and
    write its discovery file; the URL and the file. A port that cannot be bound is logged, not
    fatal: the run trains without metrics."""
    if metrics.port == 0:
        return None, None
    host = bind_host(metrics.host, alive_nodes=alive_nodes())
    try:
        url = ray.get(supervisor.start_metrics.remote(host, metrics.port))
    except Exception as error:
        logger.error("metrics disabled: cannot serve on %s:%d: %s", host, metrics.port, error)
        return None, None
    logger.info("metrics at %s", url)
    discovery = write_discovery(metrics.discovery_dir, run_id, url) if metrics.discovery_dir else None
    return url, discovery


def _fault_note(config: RunConfig) -> str:
    fault = config.fault
    if fault.kill_at_step and fault.kill_rank < config.cluster.num_workers:
        return f"injected: rank {fault.kill_rank} SIGKILLs itself after step {fault.kill_at_step}, fault.kill_at_step"
    return ""


def _group_size(config: RunConfig) -> int | tuple[int, int]:
    cluster = config.cluster
    if 0 < cluster.min_workers < cluster.num_workers:
        return (cluster.min_workers, cluster.num_workers)  # elastic: Ray Train resizes the group
    return cluster.ray_workers  # with spares: the training ranks and the spares


def _elastic_options(config: RunConfig) -> dict[str, Any]:
    """Train v2's elastic options, for an elastic group only (v1's ``ScalingConfig`` has none)."""
    from ray.train.v2._internal.constants import is_v2_enabled

    if not isinstance(_group_size(config), tuple) or not is_v2_enabled():
        return {}
    return {"elastic_resize_monitor_interval_s": config.cluster.resize_check_s}
