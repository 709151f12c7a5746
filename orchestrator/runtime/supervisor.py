"""The supervisor actor: the Ray shell around the run's Ray-free supervision cores.

Ray Train (``FailureConfig``) detects a lost worker and restarts the whole group; the new group's
ranks :meth:`Supervisor.join`, and :class:`~orchestrator.core.supervision.Supervision` decides
what that means (a fresh start, a retried call, a lost group to recover from). Writers report
shard receipts to :class:`~orchestrator.core.commit_path.CommitPath`, which decides what to
commit, retry or count lost. This actor only feeds them events and carries out the actions they
return, one small ``_execute_*`` method per kind.

Concurrency, by construction: one lock guards the cores and is held only while they decide —
never while an action runs, never across a Ray call. So a recovery that drains the writers (who
commit through :meth:`shard_written` meanwhile) cannot deadlock against itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import ray

from orchestrator.core.accounting import RunAccount
from orchestrator.core.commit_path import CommitFailed, CommitPath, CommitSucceeded, CommitVersion, ShardWritten
from orchestrator.core.recovery_plan import plan_composite
from orchestrator.core.run_view import RunView
from orchestrator.core.supervision import Supervision
from orchestrator.core.supervision_events import (
    AbandonIncomplete, DismissJoins, DrainWriters, Event, PlanComposite, PublishResume, RankJoined, RebasePolicy,
    RecordRecovery, ReplaceWriters, ResumeInfo, RunEnded, SupervisionConfig, VersionUnusable, WritersDrained,
)
from orchestrator.runtime.metrics import RunMetrics
from orchestrator.runtime.persistence_pool import WriterStats
from orchestrator.runtime.writer_pool import WriterPool
from orchestrator.store.layer_store import LayerStore
from orchestrator.store.manifest import ShardReceipt

logger = logging.getLogger(__name__)

__all__ = ["ResumeInfo", "Supervisor"]

#: How long the driver's end-of-run drain waits for the writers.
FINAL_DRAIN_S = 300.0


@ray.remote(num_cpus=0, max_concurrency=32)
class Supervisor:
    def __init__(self, *, run_id: str, store_uri: str, fsync: bool, writers_per_node: int,
                 layer_numel: Mapping[str, int], policy_actor: Any, resume: bool = False,
                 config: SupervisionConfig | None = None) -> None:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        config = config or SupervisionConfig()
        self.store = LayerStore.open(store_uri, fsync=fsync)
        self.layer_numel = dict(layer_numel)
        self.policy_actor = policy_actor
        self._lock = threading.Lock()  # the three cores and the answers; held only while they decide
        self._answered = threading.Condition(self._lock)
        self._supervision = Supervision(layers=list(layer_numel), config=config, resume=resume)
        self._commits = CommitPath(layers=list(layer_numel), config=config)
        self._view = RunView(run_id=run_id, layer_numel=self.layer_numel, account=RunAccount(started=time.monotonic()))
        self._published: dict[int, ResumeInfo] = {}
        self._dismissed: dict[int, str] = {}
        self._not_draining = threading.Event()  # writers are handed out only outside a recovery's drain
        self._not_draining.set()
        self._pool = WriterPool(store_uri=store_uri, fsync=fsync, per_node=writers_per_node,
                                supervisor=ray.get_runtime_context().current_actor)
        self._metrics: RunMetrics | None = None
        self._metrics_url: str | None = None

    # ---- the worker group ----------------------------------------------------------------
    def join(self, rank: int, world_size: int, worker_id: str) -> ResumeInfo:
        """A rank of a (new) worker group starts; returns, once its group's recovery (if any) is
        done, the same :class:`ResumeInfo` every rank of the group gets."""
        last_complete = ray.get(self.policy_actor.last_complete_step.remote())
        event = RankJoined(rank=rank, world_size=world_size, worker_id=worker_id,
                           last_complete_step=last_complete, now=time.monotonic())
        with self._lock:
            actions = self._supervision.handle(event)
            attempt = self._supervision.attempt
        self._carry_out(actions)
        with self._answered:
            self._answered.wait_for(lambda: attempt in self._published or attempt in self._dismissed)
            if attempt in self._published:
                return self._published[attempt]
            raise RuntimeError(f"attempt {attempt} was dismissed: {self._dismissed[attempt]}")

    def writers_for(self, node_id: str) -> list[Any]:
        """The writer actors on ``node_id``; during a recovery's drain, those left after it."""
        self._not_draining.wait()
        return self._pool.for_node(node_id)

    def loaded(self, rank: int, load_s: float) -> None:
        with self._lock:
            self._view.loaded(load_s)

    def version_unusable(self, version_id: str, reason: str) -> None:
        """A rank found a version corrupt while loading it; the next recovery skips it."""
        self._feed(VersionUnusable(version_id=version_id, reason=reason))

    def finish(self, ok: bool) -> None:
        self._carry_out(self._feed(RunEnded(ok=ok, reason="" if ok else "the trainer raised")))
        self._refresh_metrics()

    # ---- persistence ---------------------------------------------------------------------
    def shard_written(self, receipt_json: Mapping[str, Any], write_s: float) -> None:
        """A writer wrote one rank's shard; commits (and retries) run in this call."""
        receipt = ShardReceipt.from_json(receipt_json)
        with self._lock:
            self._view.write_latencies.append(write_s)
            actions = self._commits.handle(ShardWritten(receipt=receipt))
        self._carry_out(actions)

    def write_failed(self, layer: str, step: int, rank: int, error: str) -> None:
        with self._lock:
            self._view.write_failures += 1

    def drain(self, timeout_s: float = FINAL_DRAIN_S) -> list[str]:
        """Wait until every handed-over snapshot is written and, where whole, committed (or
        counted lost); the writers that did not answer within ``timeout_s``."""
        unanswered = self._pool.drain(timeout_s)
        if unanswered:
            logger.error("writer(s) %s did not answer the final drain within %gs: what they hold is lost",
                         ", ".join(unanswered), timeout_s)
        return list(unanswered)

    def writer_stats(self) -> list[WriterStats]:
        return self._pool.stats()

    # ---- progress ------------------------------------------------------------------------
    def progress(self, step: int, loss: float, lr: float, compute_s: float, stall_s: float,
                 coordination_s: float = 0.0) -> None:
        """Rank 0, after each step."""
        with self._lock:
            self._view.step_done(step=step, loss=loss, lr=lr, compute_s=compute_s, stall_s=stall_s,
                                 coordination_s=coordination_s, now=time.monotonic())
            last_steps = self._commits.last_steps()
        if self._metrics is not None:
            self._metrics.step_done(step, compute_s, last_steps)

    def status(self) -> dict[str, Any]:
        """Everything the driver's progress line, the summary and the metrics show."""
        with self._lock:
            return self._view.status(state=self._supervision.state.name, attempt=self._supervision.attempt,
                                     commits=self._commits, metrics_url=self._metrics_url, now=time.monotonic())

    # ---- feeding the cores and carrying out their actions ----------------------------------
    def _feed(self, event: Event) -> list[Any]:
        with self._lock:
            return self._supervision.handle(event)

    def _carry_out(self, actions: list[Any]) -> None:
        """Run ``actions`` in order, outside the lock; an action whose result is fed back to a
        core queues that core's next actions."""
        queue = deque(actions)
        while queue:
            action = queue.popleft()
            execute = getattr(self, _EXECUTORS[type(action)])
            queue.extend(execute(action))

    def _execute_drain(self, action: DrainWriters) -> list[Any]:
        self._not_draining.clear()
        try:
            unanswered = self._pool.drain(action.deadline_s)
        finally:
            self._not_draining.set()
        return self._feed(WritersDrained(attempt=action.attempt, unanswered=unanswered))

    def _execute_replace_writers(self, action: ReplaceWriters) -> list[Any]:
        self._pool.replace(action.writers)
        return []

    def _execute_abandon(self, action: AbandonIncomplete) -> list[Any]:
        with self._lock:
            return list(self._commits.handle(action))

    def _execute_plan(self, action: PlanComposite) -> list[Any]:
        return self._feed(plan_composite(self.store, self.layer_numel, action))

    def _execute_rebase(self, action: RebasePolicy) -> list[Any]:
        ray.get(self.policy_actor.restart.remote(action.world_size, action.resume_after, dict(action.persisted_steps)))
        return []

    def _execute_record(self, action: RecordRecovery) -> list[Any]:
        with self._lock:
            self._view.record_recovery(action)
        return []

    def _execute_publish(self, action: PublishResume) -> list[Any]:
        with self._answered:
            self._published[action.resume.attempt] = action.resume
            self._answered.notify_all()
        return []

    def _execute_dismiss(self, action: DismissJoins) -> list[Any]:
        with self._answered:
            self._dismissed[action.attempt] = action.reason
            self._answered.notify_all()
        return []

    def _execute_commit(self, action: CommitVersion) -> list[Any]:
        if action.delay_s > 0:
            time.sleep(action.delay_s)  # the backoff: this writer's next receipt waits, others do not
        try:
            event: Any = CommitSucceeded(record=self.store.commit(list(action.receipts)))
        except Exception as error:  # storage trouble: retried, then counted lost; training goes on
            event = CommitFailed(action=action, error=f"{type(error).__name__}: {error}")
        with self._lock:
            return list(self._commits.handle(event))

    # ---- metrics -------------------------------------------------------------------------
    def start_metrics(self, host: str, port: int, refresh_s: float = 1.0) -> str:
        """Serve the run's Prometheus metrics on ``host:port`` and refresh them every
        ``refresh_s``; returns the endpoint's URL. Lives here because the supervisor outlives
        worker-group restarts, so the counters do too."""
        if self._metrics is not None:
            return self._metrics_url or ""
        metrics = RunMetrics(self._view.run_id, self.layer_numel)
        metrics.serve(host, port)
        self._metrics = metrics
        shown = ray.util.get_node_ip_address() if host in ("0.0.0.0", "::", "") else host
        self._metrics_url = f"http://{shown}:{port}/metrics"
        threading.Thread(target=self._metrics_loop, args=(refresh_s,), name="metrics-refresh", daemon=True).start()
        logger.info("metrics at %s", self._metrics_url)
        return self._metrics_url

    def _metrics_loop(self, refresh_s: float) -> None:
        while True:
            self._refresh_metrics()
            time.sleep(refresh_s)

    def _refresh_metrics(self) -> None:
        """Pull the policy's view and the writers' stats into the metrics; never raises."""
        if self._metrics is None:
            return
        try:
            try:
                policy = ray.get(self.policy_actor.metrics_view.remote(), timeout=5)
            except Exception as error:  # the policy actor is busy or gone: export the rest
                logger.debug("policy view unavailable for metrics: %s", error)
                policy = {}
            status = self.status()  # before the writers' stats: bytes written then cover bytes committed
            self._metrics.refresh(status, self._pool.stats(timeout_s=5), policy, time.monotonic())
        except Exception as error:  # metrics must never take the run down
            logger.warning("metrics refresh failed: %s", error)

    def flush_metrics(self) -> bool:
        """At the end of the run: refresh, and wait (briefly) until Prometheus has scraped the
        final values; True if it did. The exporter ends with this actor."""
        if self._metrics is None:
            return False
        self._refresh_metrics()
        return self._metrics.await_scrape()


_EXECUTORS: dict[type, str] = {
    DrainWriters: "_execute_drain", ReplaceWriters: "_execute_replace_writers",
    AbandonIncomplete: "_execute_abandon", PlanComposite: "_execute_plan", RebasePolicy: "_execute_rebase",
    RecordRecovery: "_execute_record", PublishResume: "_execute_publish", DismissJoins: "_execute_dismiss",
    CommitVersion: "_execute_commit",
}
