"""The driver of a training run: connect to (or start) Ray, start the run's actors, run the
``TorchTrainer`` with Ray Train's failure handling, show progress, and summarise.

:func:`train` runs the built-in loop; ``layercheck.LayerCheckTrainer`` runs a user's own
``train_loop_per_worker``. Both go through the same three steps: :func:`start_run` (policy
actor, supervisor with its writer pool, metrics), ``fit_watch.fit_watched`` (the trainer's ``fit``
with progress polling, Ctrl-C and SIGTERM) and ``run_end.finish_run`` (drain, final state, drift
trace, result). This file starts a run: its store, its actors, the memory versions' period, the
metrics, and the trainer.
"""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
import uuid
from collections.abc import Mapping
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
from layercheck.orchestrator.runtime.cluster import alive_nodes, check_shared_storage, connect, node_resources
from layercheck.orchestrator.runtime.fit_watch import ProgressHook, RunHandles, fit_watched
from layercheck.orchestrator.runtime.handles import PolicyHandle, SupervisorHandle
from layercheck.orchestrator.runtime.metrics_discovery import bind_host, write_discovery
from layercheck.orchestrator.runtime.names import NAMESPACE, RunNames
from layercheck.orchestrator.runtime.policy_actor import MAX_RESTARTS, PolicyActor
from layercheck.orchestrator.runtime.run_end import RunResult, finish_run
from layercheck.orchestrator.runtime.supervisor_actor import SupervisorActor, supervisor_threads
from layercheck.orchestrator.runtime.train_report import with_callbacks
from layercheck.orchestrator.store.lease import LEASE_LOST, StoreLease
from layercheck.policies.configs import PolicyConfig

logger = logging.getLogger(__name__)


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


def _stop_for_the_lease(supervisor: SupervisorHandle, reason: str) -> None:
    supervisor.request_stop.remote(f"{LEASE_LOST} ({reason})")  # no wait: the lease's renewal thread calls it


def _lease_renewed(supervisor: SupervisorHandle, valid_until: float) -> None:
    supervisor.lease_renewed.remote(valid_until)  # no wait: as above


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
