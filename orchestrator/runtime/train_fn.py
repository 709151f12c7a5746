"""What each Ray Train worker runs: build the engine, join the run (recovering if the group is
a restart), and train with LayerCheck's protocol through a Ray-backed coordinator."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
import ray.train
import torch
from ray.exceptions import ActorUnavailableError, RayActorError

from layercheck.orchestrator.core.accounting import RankStart
from layercheck.orchestrator.core.composite import load_composite
from layercheck.orchestrator.core.memory_reads import describe_sources, needed_spans
from layercheck.orchestrator.core.roster import END, SPARE
from layercheck.orchestrator.core.run_config import FaultConfig, parse_run_config
from layercheck.orchestrator.logs import configure_process_logging
from layercheck.orchestrator.runtime.context import Incarnation, process_started_at
from layercheck.orchestrator.runtime.in_place import form_group, recovers_in_place
from layercheck.orchestrator.runtime.memory_fetch import memory_first_store
from layercheck.orchestrator.runtime.names import NAMESPACE, RunNames
from layercheck.orchestrator.runtime.spares import wait_as_spare
from layercheck.orchestrator.runtime.train_report import TrainReporter
from layercheck.orchestrator.runtime.wire import to_wire
from layercheck.orchestrator.store.errors import CorruptShardError
from layercheck.policies.decision import PersistDecision
from layercheck.workers import collective_abort
from layercheck.workers.data import load_dataset
from layercheck.workers.drift import LayerDrift
from layercheck.workers.engine import build_engine, build_model, leave_group, seek_step, shutdown, warm_engine_imports
from layercheck.workers.env import init_distributed
from layercheck.workers.loop import (
    BoundedHandover,
    CapturesOnFailure,
    Coordinator,
    KeepsMemoryVersions,
    SendsInBackground,
    StopsOnRequest,
    run_loop,
)
from layercheck.workers.shard import LayerShard

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class _Submission:
    snapshot: ray.ObjectRef
    """The snapshot in the object store (owned by this rank): handed to a new writer if its writer dies."""
    result: ray.ObjectRef
    nbytes: int
    step: int
    tries: int = 1


#: Writers a snapshot is handed to before it is counted lost (the first, and one replacement).
SUBMIT_TRIES = 2
#: How long a rank waits at the end for its last snapshots to be written before it exits.
FINAL_FLUSH_S = 300.0


class RayCoordinator:
    """The :class:`layercheck.workers.loop.Coordinator` of a Ray run: the policy actor decides, the node's
    writer actor persists, the supervisor hears progress. In-flight snapshot bytes are bounded:
    past ``max_inflight_bytes`` the rank waits for writes to finish, and says so.

    A snapshot is put in the object store once and the writer is handed its reference, which the
    rank keeps until the write resolves: when the writer is found dead (a submission fails with
    ``RayActorError``), the supervisor replaces it and the rank hands the same snapshots to the new
    one, so a writer's death loses nothing a live rank still holds. A snapshot whose second writer
    dies too is counted lost (the supervisor settles it, so the policy may persist the layer again)."""

    def __init__(
        self,
        *,
        rank: int,
        policy: Any,
        writer: Any,
        supervisor: Any,
        max_inflight_bytes: int,
        attempt: int = 1,
        capture_timeout_s: float | None = None,
        memory_period: int = 0,
    ) -> None:
        self.rank = rank
        self.attempt = attempt
        self.memory_period = memory_period
        """Steps between memory versions (``persistence.memory_period``; 0: none)."""
        self._held: dict[str, ray.ObjectRef] = {}  # the newest memory version's hand-over per layer
        self.capture_timeout_s = capture_timeout_s
        self.capture = self._capture if capture_timeout_s is not None else None
        """``StepProtocol.on_failure`` hands a survivor's capture to this (``None``: capture is off)."""
        self.policy = policy
        self.writer = writer
        self.supervisor = supervisor
        self.max_inflight_bytes = max_inflight_bytes
        self._steps_ended = False
        self._inflight: dict[str, _Submission] = {}  # the newest submission per layer
        self.blocked_s = 0.0
        self.last_report: ray.ObjectRef | None = None
        # the calls made every step leave from a thread of their own, in order: a Ray submission
        # is ~0.7 ms of CPU (measured on a 2-core VM), the training thread only queues them
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"layercheck-send-{rank}")
        self._plan: dict[int, PersistDecision] = {}
        """The quiet steps' decisions the last measured step's answer carried (``PolicyService.plan``)."""
        self._stop = False

    def report(self, drift: LayerDrift, lr: float) -> tuple[int, Future[ray.ObjectRef]]:
        """Hand the step's report to the sending thread (its Ray submission costs more than the
        rest of the per-step protocol); the handle resolves to the call's answer."""
        counts = dict(drift.numel) if drift.measured else {}  # (unused where nothing was measured)
        return drift.step, self._sender.submit(
            self._send_report, drift.step, self.rank, lr, dict(drift.l1), counts, drift.measured
        )

    def _send_report(self, *args: Any) -> ray.ObjectRef:
        self.last_report = self.policy.report.remote(*args)
        return self.last_report

    def decision(self, handle: tuple[int, Future[ray.ObjectRef]]) -> PersistDecision | None:
        """The step's decision: from the plan a measured step's answer carried (a quiet step: no
        answer collected), else the policy actor's answer."""
        step, sent = handle
        planned = self._plan.pop(step, None)
        if planned is not None:
            return planned
        data = ray.get(sent.result())
        if data is None:
            return None
        self._stop = self._stop or bool(data.get("stop"))
        self._plan = {d.step: d for d in map(PersistDecision.from_json, data.get("plan", ()))}
        return PersistDecision.from_json(data)

    def stop_requested(self) -> bool:
        """The last decision carried the run's request to stop (same on every rank)."""
        return self._stop

    def persist(self, shards: Sequence[LayerShard], *, base: bool) -> None:
        for shard in shards:
            wire = to_wire(shard, base=base)
            snapshot = ray.put(wire)  # copied into the object store: the shard's buffers may be reused
            self._inflight[shard.layer] = _Submission(
                snapshot=snapshot, result=self.writer.submit.remote(snapshot), nbytes=wire.nbytes, step=shard.step
            )
        self._bound_inflight()

    def hold(self, shards: Sequence[LayerShard]) -> None:
        """A memory version's shards to this rank's writer, which holds them in memory only. Not
        waited on, nor held to the in-flight bound: a host copy each, superseded by the next."""
        for shard in shards:
            self._held[shard.layer] = self.writer.submit.remote(ray.put(to_wire(shard, base=False, origin="memory")))

    def steps_ended(self) -> None:
        """The last step is done: the final save's snapshots are not held to the in-flight bound
        (``flush`` at the end waits for their writes)."""
        self._steps_ended = True

    def _bound_inflight(self) -> None:
        """Wait for storage while the snapshots handed over and not yet written exceed
        ``max_inflight_bytes``. The initial state (step 0, handed over once at ``attach``) is not
        held to it: bounded by one copy of the rank's slices, it would otherwise stall the first
        steps behind its write."""
        self._settle_done()
        if self._steps_ended:
            return
        bounded = [sub for sub in self._inflight.values() if sub.step > 0]
        inflight = sum(sub.nbytes for sub in bounded)
        if inflight <= self.max_inflight_bytes:
            return
        started = time.monotonic()
        logger.warning(
            "rank %d: %d snapshot bytes in flight > %d: waiting for storage",
            self.rank,
            inflight,
            self.max_inflight_bytes,
        )
        for sub in bounded:
            ray.wait([sub.result])
            inflight -= sub.nbytes
            if inflight <= self.max_inflight_bytes:
                break
        self._settle_done()
        self.blocked_s += time.monotonic() - started

    def _settle_done(self) -> bool:
        """Forget the submissions that resolved; if one resolved with its writer's death, get a new
        writer and hand it what the dead one had. True if anything was handed over again."""
        refs = [sub.result for sub in self._inflight.values()]
        if not refs:
            return False
        done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        died: Exception | None = None
        for layer, sub in list(self._inflight.items()):
            if sub.result not in done:
                continue
            try:
                ray.get(sub.result)
            except (RayActorError, ActorUnavailableError) as error:
                died = error
                continue  # kept: handed to the new writer below
            except Exception as error:  # noqa: BLE001 - the writer's own failure is reported by the writer
                logger.error("rank %d: handing %s to the writer failed: %s", self.rank, layer, error)
            del self._inflight[layer]
        return died is not None and self._replace_writer(died)

    def _replace_writer(self, error: Exception) -> bool:
        dead = self.writer
        orphaned = {layer: sub for layer, sub in self._inflight.items()}  # every submission to it fails
        again = {layer: sub for layer, sub in orphaned.items() if sub.tries < SUBMIT_TRIES}
        lost = [(layer, sub.step) for layer, sub in orphaned.items() if layer not in again]
        logger.error(
            "rank %d: the persistence writer died (%s); asking for a new one, which gets the %d snapshot(s) it held%s",
            self.rank,
            type(error).__name__,
            len(again),
            f" ({len(lost)} lost: their second writer died too)" if lost else "",
        )
        node_id = ray.get_runtime_context().get_node_id()
        writers = ray.get(self.supervisor.writer_died.remote(self.rank, node_id, dead, lost, str(error)))
        self.writer = writers[self.rank % len(writers)]
        self._inflight = {
            layer: dataclasses.replace(sub, result=self.writer.submit.remote(sub.snapshot), tries=sub.tries + 1)
            for layer, sub in again.items()
        }
        return bool(again)

    def flush(self, timeout_s: float) -> None:
        """Wait until the last drift report is answered, the newest memory version is held by the
        writer, and every snapshot handed over is written (handed to a new writer first, if its
        writer died meanwhile)."""
        deadline = time.monotonic() + timeout_s
        self.wait_sent(timeout_s)
        if self.last_report is not None:
            ray.wait([self.last_report], timeout=timeout_s)
        if self._held:
            held = list(self._held.values())
            ray.wait(held, num_returns=len(held), timeout=max(0.0, deadline - time.monotonic()))
        while self._inflight:
            refs = [sub.result for sub in self._inflight.values()]
            ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
            if not self._settle_done() or time.monotonic() >= deadline:
                break

    def wait_sent(self, timeout_s: float) -> bool:
        """Wait (bounded) until every call queued so far has left this process; False if not."""
        try:
            self._sender.submit(lambda: None).result(timeout=timeout_s)
        except TimeoutError:
            return False
        return True

    def progress(
        self, *, step: int, loss: float, lr: float, compute_s: float, stall_s: float, coordination_s: float
    ) -> None:
        self._sender.submit(self.supervisor.progress.remote, step, loss, lr, compute_s, stall_s, coordination_s)

    def _capture(self, shards: Sequence[LayerShard], *, step: int, error: BaseException) -> None:
        """Hand a survivor's capture to this node's writer and wait (bounded) until the writer holds
        it in its own memory: this process and its object-store copies may be killed right after.
        The supervisor hears when it began and how it ended (Ray Train's teardown waits for that)."""
        raised_at, started = time.time(), time.monotonic()
        self.supervisor.capture_began.remote(self.rank, self.attempt)
        held, nbytes, problem = 0, 0, ""
        try:
            refs = [self.writer.hold.remote(ray.put(to_wire(s, base=False, origin="capture"))) for s in shards]
            done, pending = ray.wait(refs, num_returns=len(refs), timeout=self.capture_timeout_s)
            for ref in done:
                try:
                    nbytes += ray.get(ref)
                    held += 1
                except Exception as failure:  # noqa: BLE001 - the writer died too: say so, lose only that
                    problem = f"{type(failure).__name__}: {failure}"
            if pending:
                problem = problem or f"{len(pending)} layer(s) not held within {self.capture_timeout_s:g}s"
        except Exception as failure:  # noqa: BLE001 - best effort: report it, never mask the step's error
            problem = f"{type(failure).__name__}: {failure}"
        report = {
            "rank": self.rank,
            "attempt": self.attempt,
            "step": step,
            "layers": held,
            "nbytes": nbytes,
            "held": held == len(shards) and not problem,
            "seconds": time.monotonic() - started,
            "raised_at": raised_at,
            "error": problem,
        }
        logger.warning(
            "rank %d: step raised (%s); handed the state at step %d of %d layers (%d bytes) to the writer in %.3fs%s",
            self.rank,
            type(error).__name__,
            step,
            held,
            nbytes,
            report["seconds"],
            f" ({problem})" if problem else "",
        )
        ray.get(self.supervisor.capture_ended.remote(report), timeout=10)


if TYPE_CHECKING:  # the type check holds RayCoordinator to the loop's protocol, its optional parts included
    _RAY_COORDINATOR: tuple[
        type[Coordinator],
        type[StopsOnRequest],
        type[CapturesOnFailure],
        type[BoundedHandover],
        type[KeepsMemoryVersions],
        type[SendsInBackground],
    ] = (RayCoordinator, RayCoordinator, RayCoordinator, RayCoordinator, RayCoordinator, RayCoordinator)


def train_fn(loop_config: dict[str, Any]) -> None:
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
        supervisor = ray.get_actor(names.supervisor, namespace=NAMESPACE)
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


class InjectedFault(RuntimeError):
    """An error ``fault.*`` asked for (``fail_in_place_recovery``, ``raise_at_step``)."""


@dataclass
class Stage:
    """How far an incarnation of a rank got."""

    model: Any = None
    """Its model, built beforehand (a warm spare's); ``None``: build it."""
    training: bool = False
    """Past its recovery: it trains (a survivor's error from here on is no failed recovery)."""


def _train(
    run: Any,
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
    supervisor = ray.get_actor(names.supervisor, namespace=NAMESPACE)
    policy = ray.get_actor(names.policy, namespace=NAMESPACE)
    runtime = ray.get_runtime_context()
    incarnation_id = Incarnation(number=incarnation).worker_id(worker_id)
    resume_ref = supervisor.join.remote(rank, world_size, incarnation_id)
    writers = ray.get(supervisor.writers_for.remote(runtime.get_node_id()))
    train_engine = None
    try:
        group_s, build_s, model = 0.0, 0.0, stage.model
        if run.cluster.in_place:  # the model needs no group: built before the wait for the others
            building = time.time()
            model = model if model is not None else build_model(run.model)
            build_s = time.time() - building
            form_group(supervisor, rank, world_size, timeout_s=run.cluster.regroup_timeout_s)
            formed = time.time()  # the wait for the others is their start and build, not this rank's
            init_distributed()
            group_s = time.time() - formed
        building = time.time()
        train_engine = build_engine(run.model, run.optim, run.engine, model=model)
        train_engine.probe.measure_every(run.policy.drift_every)
        start = RankStart(
            start_s=arrived - started_at if incarnation == 0 and started_at else 0.0,
            group_s=group_s,
            build_s=build_s + time.time() - building,
            kept_process=incarnation > 0,
            spare=stage.model is not None,
        )
        resume = ray.get(resume_ref)
        if run.fault.fails_in_place_recovery(rank=rank, incarnation=incarnation):
            raise InjectedFault(f"fault injection: rank {rank}'s recovery in its own process fails")
        if run.fault.kills_in_recovery(rank=rank, attempt=resume.attempt, incarnation=incarnation):
            logger.warning("fault injection: rank %d kills itself during its recovery", rank)
            os.kill(os.getpid(), signal.SIGKILL)
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
            supervisor.loaded.remote(rank, 0.0, {}, start.to_json())
        stage.training = True
        _run(run, train_engine, supervisor, policy, writers, rank=rank, world_size=world_size, resume=resume)
    finally:
        collective_abort.install(None)
        if train_engine is not None:
            shutdown(train_engine)
        else:
            leave_group()


def _run(
    run: Any,
    train_engine: Any,
    supervisor: Any,
    policy: Any,
    writers: list[Any],
    *,
    rank: int,
    world_size: int,
    resume: Any,
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
        memory_period=run.persistence.memory_period,
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
        coordinator.flush(timeout_s=FINAL_FLUSH_S)  # the final snapshots leave this process first
    last = max(result.losses) if result is not None and result.losses else run.steps
    loss = result.losses.get(last) if result is not None else None
    reporter.final(last, loss, blocked_s=coordinator.blocked_s)
    if run.cluster.spares:
        ray.get(supervisor.rank_finished.remote(rank))  # once every rank has, the spares end


def recover(
    target: Any,
    storage_uri: str,
    fsync: bool,
    records: Any,
    supervisor: Any,
    rank: int,
    *,
    overlays: Any = None,
    start: RankStart | None = None,
) -> None:
    """Load the composite ``records`` names, with the partial ``overlays`` (survivors' captures)
    over it, into ``target`` (a built-in ``TrainEngine`` or an attached user engine: anything with
    ``layout`` and ``layer_map``); a corrupt version — whole or overlaid: the error names it — is
    reported to the supervisor, which skips it at the next attempt. Shard files come from the
    writers' memory where one holds them (its own node's first), else from storage; of the files
    that do not hold this rank's slices, only the headers are read. ``start``: how this rank got
    here, for the recovery's timeline."""
    started = time.monotonic()
    node_id = ray.get_runtime_context().get_node_id()
    versions = [*records.values(), *(v for layer in (overlays or {}).values() for v in layer)]
    paths = [entry.path for record in versions for entry in record.shards]
    needs = needed_spans(target.layout, records)
    store, opener = memory_first_store(storage_uri, fsync, supervisor, node_id, paths, needs)
    try:
        load_composite(target, store, records, overlays=overlays)
    except CorruptShardError as error:
        ray.get(supervisor.version_unusable.remote(error.version_id, str(error)))
        raise
    load_s = time.monotonic() - started  # the headers and the prefetch too: all of the load
    sources = opener.sources
    logger.warning("rank %d loaded the composite in %.2fs: %s", rank, load_s, describe_sources(sources, load_s))
    supervisor.loaded.remote(rank, load_s, sources.to_json(), (start or RankStart()).to_json())


def fault_hook(fault: FaultConfig, rank: int, attempt: int, coordinator: RayCoordinator) -> Callable[[int], None]:
    """The injected failures, first attempt only. Raise out of the loop after ``fault.raise_at_step``.
    SIGKILL this process after ``fault.kill_at_step``
    — once the step's drift report and the snapshots handed over have left the process, so the
    failure falls exactly after that step. (A real crash can also take with it messages still in
    the send queue: then ``t_fail`` is the step before, or the layers whose shards were lost come
    from their previous versions.) On rank 0, kill this rank's writer actor after
    ``fault.kill_writer_at_step``: what it holds is lost, the next hand-over finds it dead."""
    target = fault.kill_at_step if (fault.kill_all_ranks or rank == fault.kill_rank) and attempt == 1 else 0
    raise_target = fault.raise_at_step if rank == fault.kill_rank and attempt == 1 else 0
    writer_target = fault.kill_writer_at_step if rank == 0 and attempt == 1 else 0

    def after_step(step: int) -> None:
        if step == raise_target:
            raise InjectedFault(f"fault injection: rank {rank}'s own step fails after step {step}")
        if step == writer_target:
            logger.warning("fault injection: rank %d kills its persistence writer after step %d", rank, step)
            ray.kill(coordinator.writer)
        if step == target:
            coordinator.flush(timeout_s=60)
            if fault.kill_all_ranks:  # every rank's hand-over is out before any dies, then all die at once
                torch.distributed.barrier()
            logger.warning("fault injection: rank %d kills itself after step %d", rank, step)
            os.kill(os.getpid(), signal.SIGKILL)

    return after_step
