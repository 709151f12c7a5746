"""The test-only failures, injected into the processes of a run through LayerCheck's one fault
hook (``layercheck.workers.faults``); a run config's ``[fault]`` holds only the demo's recovery
rehearsal (``kill_at_step``, ``kill_rank``).

A test states its failures as a :class:`FaultPlan` and trains inside ``with injected(plan):``,
which writes the plan to this test process's plan file. :class:`PlannedFaults` is the injector
``LAYERCHECK_FAULTS`` names (:func:`env_spec`) in every process of the test's Ray: it reads that
file at each site (again when it changed), so tests that share one local Ray inject each their
own, and none outside ``injected``. ``ray_runs.ensure_local_ray`` starts the local Ray with
``LAYERCHECK_FAULTS`` set; a test that starts a cluster of its own sets it first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layercheck.policies.config_loader import require, require_finite
from layercheck.workers.faults import AFTER_STEP, FAULTS_ENV, JOINED, SHARD_WRITE, die_after_step

logger = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """An error a :class:`FaultPlan` asked for (``fail_in_place_recovery``, ``raise_at_step``)."""


@dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """What fails, and where; each on the run's first attempt unless said otherwise."""

    kill_rank: int = 0
    """The rank ``raise_at_step`` fails, whose replacement ``kill_again_in_recovery`` kills, and
    which ``fail_in_place_recovery`` spares (the rank the rehearsal kills, ``fault.kill_rank``)."""
    kill_all_ranks_at_step: int = 0
    """Every rank kills itself after this step, at once, once all have handed their snapshots
    over: the whole group is lost, no rank survives (0: never)."""
    raise_at_step: int = 0
    """After this step completes, the worker of ``kill_rank`` raises an error of its own out of its
    loop, once (0: never): a bad batch or a bug on one rank, not a lost peer. Ray Train replaces
    that rank; in place, the others keep their processes."""
    kill_writer_at_step: int = 0
    """After this step, rank 0 kills its persistence writer actor, once (0: never)."""
    kill_policy_actor_at_step: int = 0
    """After this step, rank 0 SIGKILLs the run's policy actor's process, once (0: never), as
    ``kill -9`` of ``ray::PolicyActor`` would: Ray rebuilds it, and the group is recovered."""
    kill_supervisor_at_step: int = 0
    """After this step, rank 0 SIGKILLs the run's supervisor actor's process, once (0: never): its
    writers die with it, and the run ends."""
    fail_in_place_recovery: bool = False
    """With ``cluster.in_place`` and a killed rank: the survivors' first recovery in their own
    process raises before it loads the composite, as a load that fails once would (the ranks other
    than ``kill_rank``, in their first incarnation after it). In-place recovery is then off, and
    Ray Train replaces every rank."""
    kill_again_in_recovery: bool = False
    """With a killed or raising ``kill_rank``: its replacement SIGKILLs itself too, during its
    recovery (after it joined the run and, in place, formed the new process group; before it loads
    the composite): a second failure during the recovery. Once: the next replacement recovers."""
    stall_writes_s: float = 0.0
    """Each shard write of a stalled writer pauses this long after its header, with its temporary
    file open, as on a storage mount that hangs (0: none). The writer writes one shard at a time,
    so what it is handed waits in its queue: versions held, not yet committed."""
    stall_writes_node: str = ""
    """The Ray node id (hex) whose writers stall; empty: every node's."""
    stall_writes_after_step: int = 0
    """Only shards of versions taken after this step stall (earlier ones, e.g. the first
    versions of every layer, are written at full speed)."""

    def __post_init__(self) -> None:
        require(self.kill_rank >= 0, "kill_rank", ">= 0", self.kill_rank)
        require(self.kill_all_ranks_at_step >= 0, "kill_all_ranks_at_step", ">= 0", self.kill_all_ranks_at_step)
        require(self.kill_writer_at_step >= 0, "kill_writer_at_step", ">= 0", self.kill_writer_at_step)
        for name in ("kill_policy_actor_at_step", "kill_supervisor_at_step"):
            require(getattr(self, name) >= 0, name, ">= 0", getattr(self, name))
        require_finite(self)
        require(self.stall_writes_s >= 0, "stall_writes_s", ">= 0", self.stall_writes_s)
        require(self.stall_writes_after_step >= 0, "stall_writes_after_step", ">= 0", self.stall_writes_after_step)

    def check(self, site: str, **facts: Any) -> None:
        if site == AFTER_STEP:
            self._after_step(**facts)
        elif site == JOINED:
            self._joined(**facts)
        elif site == SHARD_WRITE:
            self._in_write(**facts)

    def stall_s(self, *, node_id: str, step: int) -> float:
        """How long a writer on ``node_id`` stalls in its write of a shard taken at ``step``."""
        here = not self.stall_writes_node or self.stall_writes_node == node_id
        return self.stall_writes_s if here and step > self.stall_writes_after_step else 0.0

    def _after_step(self, *, rank: int, step: int, attempt: int, coordinator: Any) -> None:
        if attempt != 1:
            return
        if step == self.raise_at_step and rank == self.kill_rank:
            raise InjectedFault(f"fault injection: rank {rank}'s own step fails after step {step}")
        if step == self.kill_writer_at_step and rank == 0:
            import ray

            logger.warning("fault injection: rank %d kills its persistence writer after step %d", rank, step)
            ray.kill(coordinator.writer)
        if step == self.kill_all_ranks_at_step:  # every rank's hand-over is out before any dies
            die_after_step(rank, step, coordinator, barrier=True)
        if rank == 0 and step == self.kill_policy_actor_at_step:
            sigkill_actor(coordinator.policy, "policy actor", step, coordinator)
        if rank == 0 and step == self.kill_supervisor_at_step:
            sigkill_actor(coordinator.supervisor, "supervisor", step, coordinator)

    def _joined(self, *, rank: int, attempt: int, incarnation: int) -> None:
        if self.fail_in_place_recovery and incarnation == 1 and rank != self.kill_rank:
            raise InjectedFault(f"fault injection: rank {rank}'s recovery in its own process fails")
        if self.kill_again_in_recovery and rank == self.kill_rank and attempt == 2 and incarnation == 0:
            logger.warning("fault injection: rank %d kills itself during its recovery", rank)
            os.kill(os.getpid(), signal.SIGKILL)

    def _in_write(self, *, writer: str, node_id: str, step: int, path: str) -> None:
        stall = self.stall_s(node_id=node_id, step=step)
        if stall > 0:
            import time

            logger.warning("fault injection: writer %s stalls %gs in its write of %s", writer, stall, path)
            time.sleep(stall)


def sigkill_actor(actor: Any, what: str, step: int, coordinator: Any) -> None:
    """SIGKILL ``actor``'s process (on this machine: the test's local Ray) once this rank's report
    and progress of ``step`` have left it."""
    import ray

    coordinator.wait_sent(10)
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    logger.warning("fault injection: rank 0 SIGKILLs the %s (pid %d) after step %d", what, pid, step)
    os.kill(pid, signal.SIGKILL)


class PlannedFaults:
    """The injector: the :class:`FaultPlan` in the file at ``path``, read again when it changed;
    none while there is no file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._plan: FaultPlan | None = None

    def check(self, site: str, **facts: Any) -> None:
        plan = self._current()
        if plan is not None:
            plan.check(site, **facts)

    def _current(self) -> FaultPlan | None:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            self._seen = self._plan = None
            return None
        seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if seen != self._seen:
            self._plan = FaultPlan(**json.loads(Path(self.path).read_text()))
            self._seen = seen
        return self._plan


def plan_path() -> Path:
    """This test process's plan file."""
    return Path(tempfile.gettempdir()) / f"layercheck-faults-{os.getpid()}.json"


def env_spec() -> str:
    """``LAYERCHECK_FAULTS`` for the processes of this test process's Ray: :class:`PlannedFaults`
    on :func:`plan_path`."""
    return json.dumps({"injector": f"{__name__}:PlannedFaults", "path": str(plan_path())})


@contextlib.contextmanager
def faults_env() -> Iterator[None]:
    """``LAYERCHECK_FAULTS`` in this process's environment for the ``with`` body (a Ray started in
    it: its processes inherit it), and what was there before after it."""
    before = os.environ.get(FAULTS_ENV)
    os.environ[FAULTS_ENV] = env_spec()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(FAULTS_ENV, None)
        else:
            os.environ[FAULTS_ENV] = before


@contextlib.contextmanager
def injected(plan: FaultPlan) -> Iterator[None]:
    """``plan``'s failures in the runs the ``with`` body trains (on a Ray started with
    :func:`env_spec`); none after it."""
    path = plan_path()
    staged = path.with_suffix(".tmp")
    staged.write_text(json.dumps(dataclasses.asdict(plan)))
    os.replace(staged, path)  # whole, or not there: a site never reads half a plan
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
