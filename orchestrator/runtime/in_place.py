"""In-place recovery (``cluster.in_place``): when a worker dies, Ray Train replaces only that
worker and the survivors go on in their own processes.

Ray Train 2.60 replaces only the failing workers when the backend declares replica groups
(``has_replica_groups``, as its torchft backend does): it keeps the placement group and the
surviving workers, starts a new worker in the freed slot and runs the train function there from
the top (``WorkerGroup.replace_replica_group``). It then forms no process group across the
workers, so the ranks form theirs through the supervisor (:class:`~layercheck.orchestrator.core.recovery.rendezvous.Rendezvous`),
one generation after each loss. What a survivor does when its step raises is in
:func:`layercheck.orchestrator.runtime.train_fn.train_fn`; if anything on that path fails, the
survivor's train function raises and Ray Train replaces it too, like a lost worker (it restarts the
whole group only when no worker is left running).

Never worse than a full restart: a failed recovery in a survivor's own process turns in-place
recovery off for the run (the supervisor's ``in_place_off``), so that from then on survivors leave
as they see the loss and every rank is replaced, and the survivors that leave
(:class:`LeftInPlaceRecovery`) are not charged to ``max_failures`` (:class:`SparingFailurePolicy`):
the death that sent them there was charged already, as a full restart charges it once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
import ray.train
import torch
from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend
from ray.train.v2._internal.execution.callback import ReplicaGroupCallback, WorkerGroupCallback
from ray.train.v2._internal.execution.failure_handling import FailureDecision, FailurePolicy
from ray.train.v2.api.exceptions import TrainingFailedError

from layercheck.orchestrator.core.recovery.roster import END, SPARE, TRAIN
from layercheck.orchestrator.runtime import deferred_group
from layercheck.orchestrator.runtime.context import Incarnation, WorkerContext
from layercheck.orchestrator.runtime.handles import SupervisorHandle, supervisor_named
from layercheck.orchestrator.runtime.names import RunNames
from layercheck.orchestrator.runtime.ray_trainer import LayerCheckTorchTrainer
from layercheck.orchestrator.runtime.spares import await_promotion
from layercheck.workers.collective_abort import PeerLost, request_abort
from layercheck.workers.engine import forget_trainer_state, leave_group
from layercheck.workers.env import init_distributed, reach_store, serve_store

if TYPE_CHECKING:
    from ray.train.v2._internal.execution.context import DistributedContext
    from ray.train.v2._internal.execution.worker_group import ReplicaGroup, WorkerGroup

logger = logging.getLogger(__name__)


class _InPlaceBackend(_TorchBackend):
    """Each worker a replica group of its own; no process group formed by Ray Train."""

    has_replica_groups: bool = True

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        """Nothing: the ranks form their process group through the supervisor."""


class InPlaceTorchConfig(TorchConfig):
    """The ``torch_config`` of a ``TorchTrainer`` whose lost workers are replaced in place."""

    @property
    def backend_cls(self) -> type[_InPlaceBackend]:
        return _InPlaceBackend


class LeftInPlaceRecovery(RuntimeError):
    """What a survivor raises as it leaves in-place recovery, to be replaced like a lost rank: its
    recovery in its own process failed, or in-place recovery is off for the run since one did."""


class SparingFailurePolicy(FailurePolicy):
    """Ray Train's failure policy (``charged``), except that survivors leaving in-place recovery
    (every error of the worker group a :class:`LeftInPlaceRecovery`) are replaced without a charge
    to ``max_failures``: the death that sent them there was charged. At most ``num_workers`` such
    leaves between two charged failures (each process alive at a death leaves once); more are
    charged, so that no loop of leaves can run forever."""

    def __init__(self, charged: FailurePolicy, num_workers: int) -> None:
        super().__init__(charged.failure_config)
        self._charged = charged
        self._free_left = num_workers
        self._num_workers = num_workers

    def make_decision(self, training_failed_error: TrainingFailedError) -> FailureDecision:
        failures = getattr(training_failed_error, "worker_failures", None) or {}
        if self._free_left > 0 and failures and all(isinstance(e, LeftInPlaceRecovery) for e in failures.values()):
            self._free_left -= 1
            logger.info("rank(s) %s left in-place recovery: replaced, not charged to max_failures", sorted(failures))
            return FailureDecision.RETRY
        self._free_left = self._num_workers
        return self._charged.make_decision(training_failed_error)


class InPlaceTorchTrainer(LayerCheckTorchTrainer):
    """The ``TorchTrainer`` of an in-place run: :class:`InPlaceTorchConfig` (unless given), and a
    controller that charges a failure once (:class:`SparingFailurePolicy`; Ray Train 2.60 takes no
    failure policy of ours but through the controller's arguments)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("torch_config", InPlaceTorchConfig())
        super().__init__(*args, **kwargs)

    def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
        charged = controller_init_kwargs.get("failure_policy")
        num_workers = self.scaling_config.num_workers
        if isinstance(charged, FailurePolicy) and isinstance(num_workers, int):
            controller_init_kwargs["failure_policy"] = SparingFailurePolicy(charged, num_workers)
        else:  # another Ray Train: each survivor that leaves is charged, as each lost rank is
            logger.warning("Ray Train's controller takes no failure policy here: survivors that leave are charged")
        # Train v2's (ray.train.torch's when RAY_TRAIN_V2_ENABLED); mypy sees v1's, which has none
        return super()._initialize_and_run_controller(**controller_init_kwargs)  # type: ignore[misc]


#: How long the controller's callback waits for the supervisor to take a replacement in.
REPLACING_TIMEOUT_S = 10.0
#: How long a thread beside the controller waits for the survivors' answers to the release (logged).
RELEASE_ANSWER_S = 30.0


class ReplaceInPlace(WorkerGroupCallback, ReplicaGroupCallback):
    """In Ray Train's controller, as it shuts a lost worker down to replace it in place (about 0.2 s
    after the death, before the replacement starts):

    1. the supervisor promotes a warm spare to the lost worker's rank (``cluster.spares``;
       :mod:`layercheck.orchestrator.runtime.spares`);
    2. if the lost worker trained a rank (it was no spare), every other worker is asked to release
       itself from a wait on it (:func:`layercheck.workers.collective_abort.request_abort`, beside
       its training thread): an NCCL survivor would otherwise wait in a blocked collective for the
       process group's timeout, and a survivor of any backend waiting for a decision that needs the
       lost rank's report would wait for good, with no teardown to end either as under a full
       restart (:mod:`layercheck.orchestrator.runtime.capture_hold`). A gloo survivor in a
       collective has raised already or will by itself.

    The controller waits for neither: the answers are logged from a thread of their own. (A
    worker-group callback too: the controller hands the worker group only those, and keeps the
    replica-group callbacks among them for the replica groups; and it learns the group from it.)"""

    def __init__(self, supervisor: SupervisorHandle) -> None:
        self.supervisor = supervisor
        self._group: WorkerGroup | None = None

    def after_worker_group_start(self, worker_group: WorkerGroup) -> None:
        self._group = worker_group

    def before_replica_group_shutdown(self, replica_group: ReplicaGroup) -> None:
        lost = {w.distributed_context.world_rank for w in replica_group.get_workers() if w.distributed_context}
        if not lost:
            return
        trained = lost  # unless the supervisor says which of them trained: all
        try:
            replaced = ray.get(self.supervisor.replacing.remote(sorted(lost)), timeout=REPLACING_TIMEOUT_S)
            trained = set(replaced)
        except Exception as error:  # noqa: BLE001 - never in Ray Train's way: the replacement then trains, cold
            logger.warning("could not promote a spare for Ray Train rank(s) %s: %s", sorted(lost), error)
        if not trained:  # spares: nobody waits on them, nobody is released
            logger.info("Ray Train replaces spare(s) %s", sorted(lost))
            return
        asked = release_others(self._group, lost)
        if asked:
            threading.Thread(target=_log_answers, args=(asked, lost), daemon=True, name="layercheck-release").start()


def release_others(worker_group: WorkerGroup | None, lost: set[int]) -> dict[int, Any]:
    # (Any: Ray Train's worker types the references as ray.types.ObjectRef, a dummy ray.get does not take)
    """Ask every worker of ``worker_group`` but the ``lost`` ones to release itself from a collective
    blocked on them; per world rank, the reference of its answer (an ``AbortDecision`` value)."""
    reason = f"Ray Train replaces rank(s) {sorted(lost)} in place"
    asked = {}
    for rank, worker in enumerate(worker_group.get_workers() if worker_group is not None else []):
        if rank in lost:
            continue
        try:
            asked[rank] = worker.execute_async(request_abort, reason)
        except Exception as error:  # noqa: BLE001 - that rank simply is not released
            logger.warning("could not ask rank %d to release a blocked collective: %r", rank, error)
    return asked


def _log_answers(asked: dict[int, Any], lost: set[int]) -> None:
    answers = {}
    for rank, ref in asked.items():
        try:
            answers[rank] = ray.get(ref, timeout=RELEASE_ANSWER_S)
        except Exception as error:  # noqa: BLE001 - a survivor that died or hangs: Ray Train sees to it
            answers[rank] = f"no answer ({type(error).__name__})"
    logger.info(
        "Ray Train replaces rank(s) %s in place; asked to release a blocked collective, ranks answered %s",
        sorted(lost),
        answers,
    )


@dataclass(frozen=True)
class FormedGroup:
    generation: int
    store: torch.distributed.Store
    """The group's store (rank 0 serves it, the others reach it): hand it to
    :func:`layercheck.workers.env.init_distributed`."""


def form_group(supervisor: SupervisorHandle, rank: int, world_size: int, *, timeout_s: float) -> FormedGroup:
    """Meet the other ranks at the supervisor and set the environment torch's ``env://`` reads to
    the generation's group. Rank 0 serves the group's store, on a port the OS gave it: a port
    found free and let go would race every other server on the node (it did: Ray's runtime-env
    agent listens on the node's address, where a port free on the loopback may be taken, and the
    other ranks then waited on an HTTP server)."""
    host = ray.util.get_node_ip_address()
    served = serve_store(host, world_size, timeout_s) if rank == 0 else None
    port = served.port if served is not None else 0
    address = ray.get(supervisor.rendezvous.remote(rank, world_size, host, port, timeout_s))
    store = served or reach_store(address.host, address.port, world_size, timeout_s)
    os.environ.update(
        MASTER_ADDR=address.host,
        MASTER_PORT=str(address.port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"),
    )
    logger.info("rank %d: process group generation %d at %s:%d", rank, address.generation, address.host, address.port)
    return FormedGroup(generation=int(address.generation), store=store)


def train_in_place(call: Callable[[], object], ctx: WorkerContext, start: Callable[[int, bool], Incarnation]) -> object:
    """Run the user's loop (``call()``) as this worker's rank (:class:`Seat`), its process group
    formed at the supervisor when the loop first asks torch for it
    (:mod:`~layercheck.orchestrator.runtime.deferred_group`): what the loop does before (its model
    build) overlaps the wait for the others. When the loop raises because a peer was lost (``attach``
    captured this rank's slices on the way out), leave the group and run it again as a new
    incarnation (``start(number, spare)``), whose ``attach`` loads the composite. Anything else
    raises (:func:`recovers_in_place`), and Ray Train replaces this rank.

    A warm spare (``CheckpointConfig(spares=k)``) runs the loop too, as far as it goes before it
    needs its rank or its group, and waits there for a promotion; it returns at the run's end
    without one."""
    names = RunNames(ctx.run_id)
    seat = Seat.take(supervisor_named(names.supervisor), ctx)
    if seat is None:  # the run ended before this worker started (the replacement of a last spare)
        return None
    number = 0
    while True:
        if number:
            forget_trainer_state()  # the loop's last Trainer, if it made one
        seat.incarnation = start(number, seat.spare and number == 0)
        seat.show()
        try:
            with deferred_group.pending(seat.form_group):
                result = call()
        except SpareNotNeeded:
            logger.info("spare at Ray Train rank %d: the run ended without needing it", seat.worker_rank)
            return None
        except Exception as error:
            if seat.rank is None:  # a spare's loop failed before it had a rank: Ray Train replaces it
                raise
            recovering = number > 0 and not seat.incarnation.attached
            if not recovers_in_place(names.supervisor, seat.rank, error, recovering=recovering):
                raise
            number += 1
            logger.warning(
                "rank %d: a peer was lost (%s); running the loop again in this process (incarnation %d)",
                seat.rank,
                type(error).__name__,
                number,
            )
        else:
            seat.finished()
            return result
        finally:
            leave_group()


class SpareNotNeeded(BaseException):
    """Raised in a warm spare's loop where it waits for a rank, when the run ended without
    promoting it: it unwinds the user's loop (a ``BaseException``, so that a loop's ``except
    Exception`` does not take it) and the spare's train function returns."""


@dataclass
class Seat:
    """Which LayerCheck rank this worker trains in an in-place run: Ray Train's world rank, or with
    spares the supervisor's roster's word (Ray Train's world holds the spares too, and a promoted
    spare trains the rank of a worker at another world rank). What the loop sees agrees with it:
    ``ray.train.get_context()``, ``RANK``/``WORLD_SIZE`` and the process group."""

    supervisor: SupervisorHandle
    worker_rank: int
    """Ray Train's world rank of this worker."""
    world_size: int
    """The training ranks (spares not counted)."""
    rank: int | None
    """The rank this worker trains; ``None``: a warm spare not promoted yet."""
    spare: bool
    """This worker started as a spare."""
    spares: int
    regroup_timeout_s: float
    ray_view: DistributedContext | None = None
    """Ray Train's own distributed context of this worker (its local rank, its node)."""
    incarnation: Incarnation | None = None
    """The current run of the loop (``context.Incarnation``): the group's forming is timed into it."""
    _promotion: threading.Lock = field(default_factory=threading.Lock, repr=False)
    """One wait for the promotion at a time: the roster says it once (another thread of the loop
    that reads the rank meanwhile waits here for the first one's answer)."""

    @classmethod
    def take(cls, supervisor: SupervisorHandle, ctx: WorkerContext) -> Seat | None:
        """This worker's seat as it starts (``None``: the run is over: nothing to do)."""
        context = ray.train.get_context()
        worker_rank, ray_world = context.get_world_rank(), context.get_world_size()
        seat = cls(
            supervisor=supervisor,
            worker_rank=worker_rank,
            world_size=ray_world - ctx.spares,
            rank=worker_rank,
            spare=False,
            spares=ctx.spares,
            regroup_timeout_s=ctx.regroup_timeout_s,
            ray_view=_ray_distributed_context(),
        )
        if not ctx.spares:
            return seat
        role = ray.get(supervisor.role.remote(worker_rank))
        if role.kind == SPARE:  # ready: promotable from here on; a promotion waits for the loop to need its rank
            seat.spare, seat.rank = True, None
            role = ray.get(supervisor.spare_wait.remote(worker_rank, 0.0))
        if role.kind == END:
            return None
        if role.kind == TRAIN:
            seat.rank, seat.world_size = role.rank, role.world_size
        logger.info(
            "Ray Train rank %d: %s", worker_rank, f"rank {seat.rank}" if seat.rank is not None else "warm spare"
        )
        return seat

    @property
    def ray_context(self) -> DistributedContext:
        """Ray Train's own distributed context of this worker (an in-place run is Train v2's: it has one)."""
        if self.ray_view is None:
            raise RuntimeError("Ray Train's distributed context is unknown here: in-place recovery needs Train v2")
        return self.ray_view

    def promoted(self) -> int:
        """This worker's rank. A spare waits at the roster for one, from wherever its loop first
        needed it (its rank from Ray Train, its process group); :class:`SpareNotNeeded` at the run's end."""
        with self._promotion:
            if self.rank is None:
                role = await_promotion(self.supervisor, self.worker_rank)
                if role.kind != TRAIN:
                    raise SpareNotNeeded(
                        f"the run ended; the spare at Ray Train rank {self.worker_rank} was not needed"
                    )
                self.rank, self.world_size = role.rank, role.world_size
                if self.incarnation is not None:  # its recovery's work starts here: until now it was idle
                    self.incarnation.counted_from = time.time()
                logger.warning("the spare at Ray Train rank %d goes on as rank %d", self.worker_rank, self.rank)
                self.show()
            return self.rank

    def show(self) -> None:
        """Tell the loop its rank: Ray Train's context (with spares: the training ranks' world, this
        worker's rank, and on a spare a rank whose reading waits for the promotion) and the
        environment torch's launchers set (``RANK`` unset on a spare until then; the group's
        address once it is formed)."""
        os.environ.update(WORLD_SIZE=str(self.world_size), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))
        # until the group forms, an address: accelerate (a Trainer's arguments, on CPU) wants one before it
        # asks for the group (the group's own replaces it; a survivor's is its last group's)
        os.environ.setdefault("MASTER_ADDR", ray.util.get_node_ip_address())
        if self.rank is None:
            os.environ.pop("RANK", None)
        else:
            os.environ["RANK"] = str(self.rank)
        if self.spares and self.ray_view is not None:
            _show_ray(self)

    def form_group(self) -> None:
        """Form the process group of this run of the loop (a spare: once promoted) with the others
        at the supervisor; the wait for them is timed apart from the forming."""
        entered = time.time()
        rank = self.promoted()
        arrived = max(entered, self.incarnation.counted_from if self.incarnation is not None else entered)
        group = form_group(self.supervisor, rank, self.world_size, timeout_s=self.regroup_timeout_s)
        formed = time.time()  # the wait for the others is their start and build, not this rank's
        init_distributed(store=group.store)
        if self.incarnation is not None:
            self.incarnation.group_s = time.time() - formed
            self.incarnation.waited_s += formed - arrived

    def finished(self) -> None:
        """The loop trained to the end: with spares, tell the roster (once every rank has, the
        spares waiting end)."""
        if self.spares and self.rank is not None:
            ray.get(self.supervisor.rank_finished.remote(self.rank))


def _ray_distributed_context() -> DistributedContext | None:
    """Ray Train's distributed context of this worker (Train v2's; ``None`` elsewhere)."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().distributed_context
    except (ImportError, RuntimeError):
        return None


def _show_ray(seat: Seat) -> None:
    """Ray Train's context (``ray.train.get_context()``) says the seat's rank among the training
    ranks. Its ``ray.train.report`` is a barrier over as many workers as the context's world size
    says (``TrainContext._sync_checkpoint_dir_name_across_ranks``): over the training ranks, a
    waiting spare is not waited for."""
    from ray.train.v2._internal.execution.context import DistributedContext, get_train_context

    view = seat.ray_context
    shown: Any = (
        _AwaitedRank(seat)
        if seat.rank is None
        else DistributedContext(
            world_rank=seat.rank,
            world_size=seat.world_size,
            local_rank=view.local_rank,
            local_world_size=view.local_world_size,
            node_rank=view.node_rank,
        )
    )
    get_train_context().distributed_context = shown


class _AwaitedRank:
    """A waiting spare's Ray Train distributed context: its world rank is the rank it is promoted
    to, so reading it waits for the promotion; the rest is known."""

    def __init__(self, seat: Seat) -> None:
        self._seat = seat

    @property
    def world_rank(self) -> int:
        return self._seat.promoted()

    @property
    def world_size(self) -> int:
        return self._seat.world_size

    @property
    def local_rank(self) -> int:
        return int(self._seat.ray_context.local_rank)

    @property
    def local_world_size(self) -> int:
        return int(self._seat.ray_context.local_world_size)

    @property
    def node_rank(self) -> int:
        return int(self._seat.ray_context.node_rank)


def recovers_in_place(supervisor_name: str, rank: int, error: Exception, *, recovering: bool) -> bool:
    """What a rank of an in-place run does with the ``error`` its incarnation raised (``recovering``:
    before its recovery was done). True: a peer was lost, and this rank recovers in its own
    process. False: the error is this rank's own step's (``rank_failed``), the caller raises it and
    Ray Train charges it. Otherwise this rank leaves in-place recovery and raises
    :class:`LeftInPlaceRecovery`, charged to nothing: its recovery in its own process failed
    (``recovery_failed``, which turns in-place recovery off for the run), or a peer was lost while
    it is off (``in_place_off``). Each rank tells the supervisor why it leaves first."""
    said = _first_line(error)
    if lost_a_peer(error):
        off = _in_place_off(supervisor_name)
        if off is None:
            return True
        _leave(supervisor_name, rank, "in_place_off", f"off since {off}")
        raise LeftInPlaceRecovery(f"rank {rank} leaves: in-place recovery is off since {off}") from error
    if recovering:
        _leave(supervisor_name, rank, "recovery_failed", said)
        raise LeftInPlaceRecovery(f"rank {rank}'s recovery in its own process failed: {said}") from error
    _leave(supervisor_name, rank, "rank_failed", said)
    return False


def _first_line(error: BaseException) -> str:
    text = str(error).splitlines()[0][:300] if str(error) else ""
    return f"{type(error).__name__}: {text}"


def _in_place_off(supervisor_name: str) -> str | None:
    """Which failed recovery turned in-place recovery off (``None``: it is on). A supervisor that does not
    answer leaves it on: the recovery then finds out for itself."""
    try:
        return ray.get(supervisor_named(supervisor_name).in_place_off.remote(), timeout=10)
    except Exception as failure:  # noqa: BLE001 - see above
        logger.warning("could not ask whether in-place recovery is still on: %s", failure)
        return None


def _leave(supervisor_name: str, rank: int, reason: str, detail: str) -> None:
    """Tell the supervisor why this rank raises out of its train function (one of
    ``FALLBACK_REASONS``). Best effort, never in the way of the error: unsaid, the summary says
    that no rank survived."""
    try:
        ray.get(supervisor_named(supervisor_name).in_place_refused.remote(rank, reason, detail), timeout=10)
    except Exception as failure:  # noqa: BLE001 - see above
        logger.warning("rank %d could not say why it leaves in-place recovery: %s", rank, failure)


def lost_a_peer(error: BaseException) -> bool:
    """Whether a step's error is what a survivor sees when a peer dies: a collective that failed
    (gloo: the connection closed; NCCL: aborted), Ray Train's barrier reset by the replacement, or
    a wait for a decision released by the controller (:class:`PeerLost`)."""
    from ray.train.v2._internal.execution.checkpoint.sync_actor import SynchronizationBarrierResetError

    if isinstance(error, SynchronizationBarrierResetError | torch.distributed.DistError | PeerLost):
        return True
    return isinstance(error, RuntimeError) and any(sign in str(error) for sign in PEER_LOSS_SIGNS)


#: What a collective's ``RuntimeError`` says when its peer died (gloo's TCP transport) or when its
#: communicator was aborted to release it (NCCL: ``ReplaceInPlace``; torch raises ``DistBackendError``,
#: a ``DistError``, in 2.13 — older ones a ``RuntimeError``).
PEER_LOSS_SIGNS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "gloo/transport/tcp",
    "communicator was aborted",
)
