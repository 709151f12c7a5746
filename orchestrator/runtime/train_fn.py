"""What each Ray Train worker runs: build the engine, join the run (recovering if the group is
a restart), and train with LayerCheck's protocol through a Ray-backed coordinator."""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import ray
import ray.train

from layercheck.orchestrator.core.accounting import RankStart
from layercheck.orchestrator.core.memory.reads import describe_sources, needed_spans
from layercheck.orchestrator.core.recovery.composite import Restorable, load_composite
from layercheck.orchestrator.core.recovery.events import ResumeInfo
from layercheck.orchestrator.core.recovery.roster import END, SPARE
from layercheck.orchestrator.core.run_config import FaultConfig, RunConfig, parse_run_config
from layercheck.orchestrator.logs import configure_process_logging
from layercheck.orchestrator.runtime.context import Incarnation, process_started_at
from layercheck.orchestrator.runtime.handles import (
    PolicyHandle,
    SupervisorHandle,
    WriterHandle,
    policy_named,
    supervisor_named,
)
from layercheck.orchestrator.runtime.in_place import form_group, recovers_in_place
from layercheck.orchestrator.runtime.memory_fetch import memory_first_store
from layercheck.orchestrator.runtime.names import RunNames
from layercheck.orchestrator.runtime.ray_coordinator import RayCoordinator
from layercheck.orchestrator.runtime.resume_ref import resume_of
from layercheck.orchestrator.runtime.spares import wait_as_spare
from layercheck.orchestrator.runtime.train_report import TrainReporter
from layercheck.orchestrator.store.errors import CorruptShardError
from layercheck.orchestrator.store.manifest import VersionRecord
from layercheck.orchestrator.store.recovery_source import files_for
from layercheck.workers import collective_abort, faults
from layercheck.workers.data.dataset import load_dataset
from layercheck.workers.engine import build_engine, build_model, leave_group, seek_step, shutdown, warm_engine_imports
from layercheck.workers.env import init_distributed
from layercheck.workers.loop import (
    run_loop,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from layercheck.workers.engine import TrainEngine

logger = logging.getLogger(__name__)


class TrainLoopConfig(TypedDict):
    """The ``train_loop_config`` the driver gives each worker."""

    run: dict[str, object]
    """The run's config as JSON (``RunConfig.to_json``)."""
    run_id: str


def train_fn(loop_config: TrainLoopConfig) -> None:
    """The ``train_loop_per_worker`` of the run's ``TorchTrainer``. With ``cluster.in_place``, a
    step that raises because a peer was lost does not end it: this rank leaves the broken group,
    meets the others (the lost rank's replacement among them) in a new one, and trains on from
    the recovery's resume step in this same process. Anything else raises, as does a failure on
    that path: Ray Train then replaces this rank like a lost one (the whole group, if no rank is
    left running)."""
    configure_process_logging()  # an actor/worker process has no main of ours
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's ZeRO collective renames
    for name in ("layercheck.workers", "layercheck.orchestrator"):
        logging.getLogger(name).setLevel(logging.WARNING)
    run = parse_run_config(loop_config["run"])
    names = RunNames(loop_config["run_id"])
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    worker_id = ray.get_runtime_context().get_actor_id() or f"pid{os.getpid()}"
    incarnation, started_at = 0, process_started_at()
    model = None
    if run.cluster.spares:  # Ray Train's world: the training ranks and the spares; the roster says which
        supervisor = supervisor_named(names.supervisor)
        role = ray.get(supervisor.role.remote(rank))
        if role.kind == SPARE:
            role, model = wait_as_spare(supervisor, rank, lambda: build_model(run.model), warm_engine_imports)
            started_at = 0.0  # promoted: this process was up and warm long before the failure
        if role.kind == END:
            return
        rank, world_size = role.rank, role.world_size
    while True:
        stage = Stage(model=model)
        model = None  # a model is built for one engine
        try:
            _train(
                run,
                names,
                rank,
                world_size,
                worker_id=worker_id,
                incarnation=incarnation,
                started_at=started_at,
                stage=stage,
            )
            return
        except Exception as error:
            recovering = bool(incarnation) and not stage.training
            if not run.cluster.in_place or not recovers_in_place(names.supervisor, rank, error, recovering=recovering):
                raise
            incarnation += 1
            logger.warning(
                "rank %d: a peer was lost (%s); recovering in this process (incarnation %d)",
                rank,
                type(error).__name__,
                incarnation,
            )


@dataclass
class Stage:
    """How far an incarnation of a rank got."""

    model: PreTrainedModel | None = None
    """Its model, built beforehand (a warm spare's); ``None``: build it."""
    training: bool = False
    """Past its recovery: it trains (a survivor's error from here on is no failed recovery)."""


def _train(
    run: RunConfig,
    names: RunNames,
    rank: int,
    world_size: int,
    *,
    worker_id: str,
    incarnation: int,
    started_at: float,
    stage: Stage,
) -> None:
    """One incarnation of this rank: join the run, form the process group (in-place runs), build
    the engine, load the composite if the group recovers, and train to the end."""
    arrived = time.time()
    supervisor = supervisor_named(names.supervisor)
    policy = policy_named(names.policy)
    runtime = ray.get_runtime_context()
    incarnation_id = Incarnation(number=incarnation).worker_id(worker_id)
    resume_ref = supervisor.join.remote(rank, world_size, incarnation_id, run.engine.backend)
    writers = ray.get(supervisor.writers_for.remote(runtime.get_node_id()))
    train_engine = None
    try:
        group_s, build_s, model = 0.0, 0.0, stage.model
        if run.cluster.in_place:  # the model needs no group: built before the wait for the others
            building = time.time()
            model = model if model is not None else build_model(run.model)
            build_s = time.time() - building
            group = form_group(supervisor, rank, world_size, timeout_s=run.cluster.regroup_timeout_s)
            formed = time.time()  # the wait for the others is their start and build, not this rank's
            init_distributed(store=group.store, engine=run.engine.backend)
            group_s = time.time() - formed
        building = time.time()
        train_engine = build_engine(run.model, run.optim, run.engine, model=model)
        train_engine.probe.measure_every(run.policy.drift_every)
        start = RankStart(
            rank=rank,
            start_s=arrived - started_at if incarnation == 0 and started_at else 0.0,
            group_s=group_s,
            build_s=build_s + time.time() - building,
            kept_process=incarnation > 0,
            spare=stage.model is not None,
        )
        resume = resume_of(ray.get(resume_ref))
        faults.fault_point(faults.JOINED, rank=rank, attempt=resume.attempt, incarnation=incarnation)
        if resume.records is not None:
            recover(
                train_engine,
                run.storage_uri,
                run.persistence.fsync,
                resume.records,
                supervisor,
                rank,
                overlays=resume.overlays,
                start=start,
            )
            seek_step(train_engine, resume.start_step - 1)
        elif resume.attempt > 1:  # a restart with nothing to load: its start and build are still the recovery's
            supervisor.loaded.remote(rank, 0.0, {}, start)
        stage.training = True
        _run(run, train_engine, supervisor, policy, writers, rank=rank, world_size=world_size, resume=resume)
    finally:
        collective_abort.install(None)
        if train_engine is not None:
            shutdown(train_engine)
        else:
            leave_group()


def _run(
    run: RunConfig,
    train_engine: TrainEngine,
    supervisor: SupervisorHandle,
    policy: PolicyHandle,
    writers: list[WriterHandle],
    *,
    rank: int,
    world_size: int,
    resume: ResumeInfo,
) -> None:
    """Train from the resume step to the end with LayerCheck's protocol, and report the end."""
    coordinator = RayCoordinator(
        rank=rank,
        policy=policy,
        writer=writers[rank % len(writers)],
        supervisor=supervisor,
        max_inflight_bytes=run.persistence.max_inflight_bytes,
        attempt=resume.attempt,
        capture_timeout_s=run.persistence.capture_hand_over_s,
        memory_period=run.persistence.memory_period_at_start,
        decision_timeout_s=run.persistence.decision_timeout_s,
    )
    kill = fault_hook(run.fault, rank, resume.attempt, coordinator)
    # with spares Ray Train's world has ranks that do not train: its report, a barrier over all, is off
    reporter = TrainReporter(rank=rank, every=run.log_every, supervisor=supervisor, to_ray=not run.cluster.spares)
    # Ray Train's controller releases this rank from a collective blocked on a lost peer (NCCL), so it
    # captures; in place it must be released to recover at all (ReplaceInPlace)
    released = run.persistence.capture or run.cluster.in_place
    abort = collective_abort.install(collective_abort.for_current_group()) if released else None
    result = None
    if resume.start_step <= run.steps:
        result = run_loop(
            train_engine,
            load_dataset(run.data),
            coordinator,
            start_step=resume.start_step,
            end_step=run.steps,
            rank=rank,
            world_size=world_size,
            after_step=kill,
            save_final=run.persistence.save_final,
            report_step=reporter,
            abort=abort,
        )
        # the final snapshots leave this process first; on storage that hangs, no longer than the
        # driver's final drain waits for them (what is not written by then is counted lost there)
        coordinator.flush(timeout_s=run.persistence.stop_drain_s)
    last = max(result.losses) if result is not None and result.losses else run.steps
    loss = result.losses.get(last) if result is not None else None
    reporter.final(last, loss, blocked_s=coordinator.blocked_s)
    if run.cluster.spares:
        ray.get(supervisor.rank_finished.remote(rank))  # once every rank has, the spares end


def recover(
    target: Restorable,
    storage_uri: str,
    fsync: bool,
    records: Mapping[str, VersionRecord],
    supervisor: SupervisorHandle,
    rank: int,
    *,
    overlays: Mapping[str, tuple[VersionRecord, ...]] | None = None,
    start: RankStart | None = None,
) -> None:
    """Load the composite ``records`` names, with the partial ``overlays`` (survivors' captures)
    over it, into ``target`` (a built-in ``TrainEngine`` or an attached user engine: anything with
    ``layout`` and ``layer_map``); a corrupt version — whole or overlaid: the error names it — is
    reported to the supervisor, which skips it at the next attempt. Shard files come from the
    writers' memory where one holds them (its own node's first), else from storage; of the files
    that do not hold this rank's slices, none is read where the records say which file holds what
    (one per version for its metadata), else only their headers. ``start``: how this rank got
    here, for the recovery's timeline."""
    started = time.monotonic()
    node_id = ray.get_runtime_context().get_node_id()
    versions = [*records.values(), *(v for layer in (overlays or {}).values() for v in layer)]
    needs = needed_spans(target.layout, records)
    paths = files_for(versions, needs)  # this rank's files and each version's metadata file, not every rank's
    store, opener = memory_first_store(storage_uri, fsync, supervisor, node_id, paths, needs)
    try:
        load_composite(target, store, records, overlays=overlays)
    except CorruptShardError as error:
        ray.get(supervisor.version_unusable.remote(error.version_id, str(error)))
        raise
    load_s = time.monotonic() - started  # the headers and the prefetch too: all of the load
    sources = opener.sources
    logger.warning("rank %d loaded the composite in %.2fs: %s", rank, load_s, describe_sources(sources, load_s))
    supervisor.loaded.remote(rank, load_s, sources.to_json(), start or RankStart())


def fault_hook(fault: FaultConfig, rank: int, attempt: int, coordinator: RayCoordinator) -> Callable[[int], None]:
    """The loop's ``after_step``: the fault site after each step (:mod:`layercheck.workers.faults`),
    with the run's recovery rehearsal (``fault.kill_at_step``, ``fault.kill_rank``) installed in
    this process. Nothing fails there unless an injector is installed."""
    faults.rehearse(fault.kill_at_step, fault.kill_rank)

    def after_step(step: int) -> None:
        faults.fault_point(faults.AFTER_STEP, rank=rank, step=step, attempt=attempt, coordinator=coordinator)

    return after_step
