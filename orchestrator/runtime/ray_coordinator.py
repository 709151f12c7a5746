"""A Ray run's coordinator on each rank: the policy actor decides, the node's writer actor
persists, the supervisor hears progress; snapshots are handed over through the object store, so a
writer's death loses nothing a live rank still holds.

One file because it is one class, the rank's side of the Ray protocol: the hand-overs, the
in-flight bound, the writer replacement and the background sender all act on the same snapshots in
flight, which none of them could track alone."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
import ray.train
from ray.exceptions import ActorUnavailableError, RayActorError

from layercheck.orchestrator.core.persistence.storage_waits import StorageWaits
from layercheck.orchestrator.core.recovery.capture_window import CaptureReport
from layercheck.orchestrator.core.stall_watch import never_reported
from layercheck.orchestrator.runtime.handles import PolicyHandle, SupervisorHandle, WriterHandle
from layercheck.orchestrator.runtime.policy_actor import PolicyActorLost
from layercheck.orchestrator.runtime.wire import to_wire
from layercheck.policies.decision import PersistDecision
from layercheck.workers import collective_abort
from layercheck.workers.collective_abort import PeerLost
from layercheck.workers.coordinator import (
    BoundedHandover,
    CapturesOnFailure,
    Coordinator,
    KeepsHostBuffers,
    KeepsMemoryVersions,
    SendsInBackground,
    StopsOnRequest,
)
from layercheck.workers.drift.probe import LayerDrift
from layercheck.workers.loop import SEND_WAIT_S
from layercheck.workers.progress import StepProgress
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
#: How often a rank waiting for a decision looks whether it was told that a peer is gone.
RELEASE_POLL_S = 0.5
#: What the sending thread hands back for a report: its answer's future (a measured step), or the
#: call's reference (a quiet step, whose answer is rarely read).
Sent = Future[Any] | ray.ObjectRef
#: The longest a rank waits for a decision unless told (``persistence.decision_timeout_s``). Every
#: rank has sent its report of the step by then (the rank finished the next step with them), so
#: only a hung rank or a lost report makes it this long.
DECISION_TIMEOUT_S = 600.0
#: How long a rank that waited past its decision timeout waits for the policy actor to say who is missing.
MISSING_ASK_S = 10.0


class RankHung(TimeoutError):
    """A rank waited past ``persistence.decision_timeout_s`` for a step's decision: the ranks it
    names never reported the step (hung, not dead: Ray still sees their processes). Raised on
    the waiting ranks, it fails the group, which is then recovered (its processes, the hung one's
    too, replaced), instead of a run that stalls."""


class RayCoordinator:
    """The :class:`layercheck.workers.coordinator.Coordinator` of a Ray run: the policy actor decides, the node's
    writer actor persists, the supervisor hears progress. In-flight snapshot bytes are bounded:
    past ``max_inflight_bytes`` the rank waits for writes to finish, and says so.

    A snapshot is put in the object store once and the writer is handed its reference, which the
    rank keeps until the write resolves: when the writer is found dead (a submission fails with
    ``RayActorError``), the supervisor replaces it and the rank hands the same snapshots to the new
    one, so a writer's death loses nothing a live rank still holds. A snapshot whose second writer
    dies too is counted lost (the supervisor settles it, so the policy may persist the layer again).

    Where the loop lets it keep the snapshots' host buffers (:class:`KeepsHostBuffers`), a snapshot
    is handed over on a thread of the rank's own, off the training thread: the copy into the object
    store (``ray.put``, a memcpy of the whole shard: 2-7 GB/s measured on a 2-core VM), the buffers
    back to the loop, then the submission to the writer (~0.7 ms of CPU). The in-flight bound
    counts the snapshots being handed over; a hand-over that failed raises on the training thread
    at its next ``persist`` (or ``flush``)."""

    def __init__(
        self,
        *,
        rank: int,
        policy: PolicyHandle,
        writer: WriterHandle,
        supervisor: SupervisorHandle,
        max_inflight_bytes: int,
        attempt: int = 1,
        capture_timeout_s: float | None = None,
        memory_period: int = 0,
        decision_timeout_s: float = DECISION_TIMEOUT_S,
    ) -> None:
        self.rank = rank
        self.decision_timeout_s = decision_timeout_s
        self.attempt = attempt
        self.memory_period = memory_period
        """Steps between memory versions until a decision carries the run's (``persistence.memory_period``;
        0: none, or ``"auto"``: from the second step of the group on, the decisions carry it)."""
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
        self._waits = StorageWaits()
        self.last_report: ray.ObjectRef | None = None
        # the calls made every step leave from a thread of their own, in order: a Ray submission
        # is ~0.7 ms of CPU (measured on a 2-core VM), the training thread only queues them
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"layercheck-send-{rank}")
        self._putter = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"layercheck-put-{rank}")
        self._handing: deque[Future[None]] = deque()  # the putting thread's hand-overs, in order
        self._putting = 0  # bytes (past step 0) handed to it and not yet submitted to the writer
        self._lock = threading.RLock()  # the writer and the submissions, shared with the putting thread
        self._recycle: Callable[[LayerShard], None] | None = None
        """Set where the loop gives the snapshots' buffers away (:meth:`keep_host_buffers`)."""
        self._plan: dict[int, PersistDecision] = {}
        """The quiet steps' decisions the last measured step's answer carried (``PolicyService.plan``)."""
        self._stop = False

    @property
    def blocked_s(self) -> float:
        """Seconds the training thread waited for storage (the in-flight byte bound)."""
        return self._waits.blocked_s

    def report(self, drift: LayerDrift, lr: float) -> tuple[int, Future[Sent]]:
        """Hand the step's report to the sending thread (its Ray submission costs more than the
        rest of the per-step protocol); the handle resolves once the report has left."""
        counts = dict(drift.numel) if drift.measured else {}  # (unused where nothing was measured)
        return drift.step, self._sender.submit(
            self._send_report, drift.step, self.rank, lr, dict(drift.l1), counts, drift.measured
        )

    def _send_report(
        self, step: int, rank: int, lr: float, l1: dict[str, float], counts: dict[str, int], measured: bool
    ) -> Sent:
        """Send the report. A measured step's answer is collected a whole step later, long after
        it came: it is taken as a future, which Ray completes (fetched and deserialized) on a thread
        of its own as the answer comes, so the training thread reads it in ~20 µs instead of
        fetching it then (``ray.wait`` and ``ray.get``: 0.36 ms on an idle 2-core VM, 1-6 ms beside
        training; ``python bench/probes/ray_answer.py``). A quiet step's answer is read only
        where no plan holds its decision (the quiet steps right after a start): its reference, the
        future taken then, since taking one costs the process ~0.2 ms of the interpreter lock."""
        self.last_report = self.policy.report.remote(step, rank, lr, l1, counts, measured)
        return self.last_report.future() if measured else self.last_report

    def decision(self, handle: tuple[int, Future[Sent]]) -> PersistDecision | None:
        """The step's decision: from the plan a measured step's answer carried (a quiet step: no
        answer collected), else the policy actor's answer."""
        step, sent = handle
        planned = self._plan.pop(step, None)
        if planned is not None:
            return planned
        answer = sent.result()
        data = self._answer(answer if isinstance(answer, Future) else answer.future(), step)
        if data is None:
            return None
        if data.get("refused"):  # a rebuilt policy actor: it decides nothing for this group
            raise PolicyActorLost(f"rank {self.rank}: {data['refused']}: this group is recovered")
        self._stop = self._stop or bool(data.get("stop"))
        self._plan = {d.step: d for d in map(PersistDecision.from_json, data.get("plan", ()))}
        return PersistDecision.from_json(data)

    def _answer(self, answer: Future[Any], step: int) -> Any:
        """The policy actor's ``answer`` for ``step`` (an error the call raised, raised here). The
        actor answers once every rank reported the step, so never when a peer died before its report
        left: this rank then waits outside any collective, where nothing fails. It raises
        :class:`PeerLost` once the rank is told a peer is gone (by Ray Train's controller,
        :mod:`layercheck.workers.collective_abort`), as its next step would, and :class:`RankHung`
        after ``decision_timeout_s`` if it is never told. A call that died with the policy
        actor's process raises :class:`PolicyActorLost`: the group is recovered (``policy_actor.py``)."""
        deadline = time.monotonic() + self.decision_timeout_s
        while not wait_for([answer], timeout=RELEASE_POLL_S).done:
            if lost := collective_abort.peer_lost():
                raise PeerLost(f"rank {self.rank}: no decision for step {step}, and a peer is gone ({lost})")
            if time.monotonic() > deadline:
                raise RankHung(self._hung_message(step))
        try:
            return answer.result()
        except (RayActorError, ActorUnavailableError) as error:
            raise PolicyActorLost(
                f"rank {self.rank}: the policy actor died before it answered step {step} "
                f"({type(error).__name__}): this group is recovered"
            ) from error

    def _hung_message(self, step: int) -> str:
        """Why this rank stops waiting for ``step``'s decision: the ranks that never reported it,
        as the policy actor counts them (or that it did not say, if it does not answer either)."""
        waited = f"rank {self.rank}: no decision for step {step} in {self.decision_timeout_s:g}s"
        try:
            missing = ray.get(self.policy.missing_reports.remote(step), timeout=MISSING_ASK_S)
        except Exception as error:  # noqa: BLE001 - the timeout is the error; this only explains it
            return f"{waited} (the policy actor did not say which ranks are missing: {type(error).__name__})"
        if not missing:
            return f"{waited}, though every rank reported it (its decision was lost on the way)"
        return (
            f"{waited}: never reported by {never_reported(missing)}: hung, not dead; this group is recovered "
            "(persistence.decision_timeout_s)"
        )

    def stop_requested(self) -> bool:
        """The last decision carried the run's request to stop (same on every rank)."""
        return self._stop

    def keep_host_buffers(self, recycle: Callable[[LayerShard], None], *, pinned: bool) -> bool:
        """``KeepsHostBuffers``: the snapshots are put in the object store off the training thread,
        out of the loop's buffers (pinned ones too: they come back within the copy's time)."""
        self._recycle = recycle
        return True

    def persist(self, shards: Sequence[LayerShard], *, base: bool) -> None:
        if self._recycle is None:  # the shards' buffers are reused once this returns: hand them over now
            self._hand_over(shards, base, counted=False)
        elif shards:
            with self._lock:
                self._putting += sum(shard.nbytes for shard in shards if shard.step > 0)
            self._handing.append(self._putter.submit(self._hand_over, shards, base, counted=True))
        self._bound_inflight()

    def _hand_over(self, shards: Sequence[LayerShard], base: bool, *, counted: bool) -> None:
        """Each shard into the object store (a copy: its buffers may be reused after), its buffers
        back to the loop where it gave them away, and the snapshot to the writer; then forget what
        was written (a dead writer replaced). ``counted``: their bytes are in ``_putting``."""
        bounded = [shard.nbytes if counted and shard.step > 0 else 0 for shard in shards]
        for index, shard in enumerate(shards):
            try:
                snapshot = ray.put(to_wire(shard, base=base))
            except BaseException:
                with self._lock:
                    self._putting -= sum(bounded[index:])  # (none of the rest is handed over)
                if self._recycle is not None:  # nor kept: their buffers go back to the loop's pool
                    for rest in shards[index:]:
                        self._recycle(rest)
                raise
            if self._recycle is not None:  # (copied into the object store: the loop may reuse them)
                self._recycle(shard)
            with self._lock:
                self._putting -= bounded[index]
                self._inflight[shard.layer] = _Submission(
                    snapshot=snapshot, result=self.writer.submit.remote(snapshot), nbytes=shard.nbytes, step=shard.step
                )
        self._settle_done()

    def _handed(self, *, wait: bool = False, deadline: float | None = None) -> BaseException | None:
        """Forget the putting thread's finished hand-overs (``wait``: wait for each, until
        ``deadline`` if given); the first that failed, to be raised on the training thread."""
        failed: BaseException | None = None
        while self._handing and (wait or self._handing[0].done()):
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self._handing[0].result(timeout=timeout)
            except FutureTimeout:
                break  # still putting: left for a later call
            except Exception as error:  # noqa: BLE001 - handed to the caller to raise
                failed = failed or error
            self._handing.popleft()
        return failed

    def hold(self, shards: Sequence[LayerShard]) -> None:
        """A memory version's shards to this rank's writer, which holds them in memory only. Not
        waited on, nor held to the in-flight bound: a host copy each, superseded by the next."""
        with self._lock:
            writer = self.writer
        for shard in shards:  # (on the training thread: not held to the bound, so not queued behind it)
            self._held[shard.layer] = writer.submit.remote(ray.put(to_wire(shard, base=False, origin="memory")))
            if self._recycle is not None:  # (copied into the object store: the loop may reuse them)
                self._recycle(shard)

    def steps_ended(self) -> None:
        """The last step is done: the final save's snapshots are not held to the in-flight bound
        (``flush`` at the end waits for their writes)."""
        self._steps_ended = True

    def _bound_inflight(self) -> None:
        """Wait for storage while the snapshots handed over and not yet written exceed
        ``max_inflight_bytes``. The initial state (step 0, handed over once at ``attach``) is not
        held to it: bounded by one copy of the rank's slices, it would otherwise stall the first
        steps behind its write."""
        if (failed := self._handed()) is not None:
            raise failed
        if self._steps_ended:
            return
        inflight = self._inflight_bytes()
        if inflight > self.max_inflight_bytes:  # (it may count what was written since the last settle)
            self._settle_done()
            inflight = self._inflight_bytes()
        if inflight <= self.max_inflight_bytes:
            return
        started = self._waits.begin(self.rank, inflight, self.max_inflight_bytes)
        if (failed := self._handed(wait=True)) is not None:
            raise failed
        inflight = self._inflight_bytes()  # (the putting thread forgot what was written meanwhile)
        with self._lock:
            bounded = [sub for sub in self._inflight.values() if sub.step > 0]
        for sub in bounded:
            if inflight <= self.max_inflight_bytes:
                break
            ray.wait([sub.result])
            inflight -= sub.nbytes
        self._settle_done()
        self._waits.end(started)

    def _inflight_bytes(self) -> int:
        """Snapshot bytes (past step 0) handed over and not known to be written."""
        with self._lock:
            return self._putting + sum(sub.nbytes for sub in self._inflight.values() if sub.step > 0)

    def _settle_done(self) -> bool:
        """Forget the submissions that resolved; if one resolved with its writer's death, get a new
        writer and hand it what the dead one had. True if anything was handed over again. Holds
        the lock throughout: the putting thread submits to the writer there is after it."""
        with self._lock:
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
        failed = self._handed(wait=True, deadline=deadline)
        if self.last_report is not None:
            ray.wait([self.last_report], timeout=timeout_s)
        if self._held:
            held = list(self._held.values())
            ray.wait(held, num_returns=len(held), timeout=max(0.0, deadline - time.monotonic()))
        while self._inflight:
            with self._lock:
                refs = [sub.result for sub in self._inflight.values()]
            ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
            if not self._settle_done() or time.monotonic() >= deadline:
                break
        if failed is not None:  # (what was handed over is written first)
            raise failed

    def wait_sent(self, timeout_s: float) -> bool:
        """Wait (bounded) until every call queued so far has left this process, snapshots handed to
        the writer included; False if not."""
        deadline = time.monotonic() + timeout_s
        try:
            self._sender.submit(lambda: None).result(timeout=timeout_s)
            self._putter.submit(lambda: None).result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return False
        return True

    def progress(self, progress: StepProgress) -> None:
        self._sender.submit(self.supervisor.progress.remote, progress)

    def _capture(self, shards: Sequence[LayerShard], *, step: int, error: BaseException) -> None:
        """Hand a survivor's capture to this node's writer and wait (bounded) until the writer holds
        it in its own memory: this process and its object-store copies may be killed right after.
        The supervisor hears when it began and how it ended (Ray Train's teardown waits for that)."""
        raised_at, started = time.time(), time.monotonic()
        self.supervisor.capture_began.remote(self.rank, self.attempt)
        if not self.wait_sent(SEND_WAIT_S):  # the snapshots handed over before it reach the writer first
            logger.error(
                "rank %d: snapshots handed over before the capture had not left after %gs", self.rank, SEND_WAIT_S
            )
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
        report = CaptureReport(
            rank=self.rank,
            attempt=self.attempt,
            step=step,
            layers=held,
            nbytes=nbytes,
            held=held == len(shards) and not problem,
            seconds=time.monotonic() - started,
            raised_at=raised_at,
            error=problem,
        )
        logger.warning(
            "rank %d: step raised (%s); handed the state at step %d of %d layers (%d bytes) to the writer in %.3fs%s",
            self.rank,
            type(error).__name__,
            step,
            held,
            nbytes,
            report.seconds,
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
        type[KeepsHostBuffers],
    ] = (RayCoordinator,) * 7
