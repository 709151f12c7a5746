"""The supervisor: the run's central view and its recovery.

Ray Train (``FailureConfig``) detects a lost worker and restarts the whole group; the
supervisor sees the new group when its ranks :meth:`Supervisor.join`, and the first of them
triggers recovery: find ``t_fail`` (the last step every rank completed), let the writers finish
what they hold, plan the composite from the manifest (skipping versions found unusable), rebase
the policy, and hand every rank the versions to load and the step to resume at (``t_fail + 1``).
It also commits versions once every rank's shard is written, and accounts the run's time.

The decisions are values (:class:`ResumeInfo`, :class:`State`); the actor routes them.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator.logs import configure_process_logging
from orchestrator.core.accounting import RunAccount
from orchestrator.core.commit_tracker import CommitTracker
from orchestrator.store.manifest import ShardReceipt, VersionRecord
from orchestrator.runtime.metrics import RunMetrics
from orchestrator.runtime.persistence_pool import PersistenceWriter, WriterStats
from orchestrator.store.recovery_source import resolve_plan
from orchestrator.store.layer_store import LayerStore
from policies.plan import NoUsableVersionError, newest_recoverable_step

logger = logging.getLogger(__name__)


class State(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (State.FINISHED, State.FAILED)


@dataclass(frozen=True)
class ResumeInfo:
    """What every rank of a worker group is told when it joins."""

    attempt: int
    start_step: int
    """The first step to train (1 on a fresh start, t_fail + 1 after a recovery)."""
    records: Mapping[str, VersionRecord] | None = None
    """Per layer, the committed version to load; ``None``: start from the initial weights."""


@dataclass
class LayerStats:
    versions: int = 0
    bytes: int = 0
    last_step: int | None = None


@dataclass
class Progress:
    step: int = 0
    loss: float = float("nan")
    lr: float = 0.0
    step_s: float = 0.0


@ray.remote(num_cpus=0, max_concurrency=32)
class Supervisor:
    def __init__(self, *, run_id: str, store_uri: str, fsync: bool, writers_per_node: int,
                 layer_numel: Mapping[str, int], policy_actor: Any, resume: bool = False) -> None:
        configure_process_logging()  # the actor process has no main of ours
        self.run_id = run_id
        self.store = LayerStore.open(store_uri, fsync=fsync)
        self.store_uri = store_uri
        self.fsync = fsync
        self.writers_per_node = writers_per_node
        self.layer_numel = dict(layer_numel)
        self.policy_actor = policy_actor
        self.resume = resume
        """Continue the run whose versions are already in the store (``layercheck train --resume``)."""
        self.state = State.STARTING
        self.account = RunAccount(started=time.monotonic())
        self.tracker = CommitTracker()
        self.layers = {name: LayerStats() for name in layer_numel}
        self.progress_ = Progress()
        self.write_latencies: list[float] = []
        self.write_failures = 0
        self.unusable: dict[str, str] = {}
        self._lock = threading.RLock()  # state shared with the commit path; held briefly
        self._join_lock = threading.Lock()  # serialises joins, held through a recovery
        self._attempt = 0
        self._members: dict[int, str] = {}
        self._resume: ResumeInfo | None = None
        self._writers: dict[str, list[Any]] = {}
        self._metrics: RunMetrics | None = None
        self._metrics_url: str | None = None

    # ---- worker group -------------------------------------------------------------------
    def writers_for(self, node_id: str) -> list[Any]:
        """The writer actors on ``node_id``, started on first use."""
        with self._lock:
            if node_id not in self._writers:
                self._writers[node_id] = [
                    PersistenceWriter.options(
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=True),
                    ).remote(self.store_uri, self.fsync, ray.get_runtime_context().current_actor)
                    for _ in range(self.writers_per_node)
                ]
                logger.info("started %d writer(s) on node %s", self.writers_per_node, node_id[:12])
            return self._writers[node_id]

    def join(self, rank: int, world_size: int, worker_id: str) -> ResumeInfo:
        """A rank of a (new) worker group starts; the first rank of a new group after a loss
        triggers recovery. Every rank of the group gets the same :class:`ResumeInfo`."""
        with self._join_lock:
            if self._members.get(rank) == worker_id:
                assert self._resume is not None
                return self._resume  # a retried call
            if self._attempt == 0 or rank in self._members:
                self._attempt += 1
                self._members = {}
                if self._attempt > 1 or self.resume:
                    self._resume = self._start_attempt(world_size, lost_group=self._attempt > 1)
                else:  # a fresh start, perhaps with fewer workers than asked for (elastic)
                    ray.get(self.policy_actor.restart.remote(world_size, 0, {}))
                    self._resume = ResumeInfo(1, 1)
                self.state = State.RUNNING
            self._members[rank] = worker_id
            assert self._resume is not None
            return self._resume

    def _start_attempt(self, world_size: int, *, lost_group: bool) -> ResumeInfo:
        """Recover: after a lost worker group at its last completed step, or (``--resume``) at
        the store's newest recoverable step."""
        now = time.monotonic()
        self.state = State.RECOVERING
        if lost_group:
            t_fail = ray.get(self.policy_actor.last_complete_step.remote())
            logger.warning("worker group lost after step %d; recovering with %d workers", t_fail, world_size)
            self.drain()  # writers commit through shard_written, so _lock must not be held here
        else:
            t_fail = newest_recoverable_step(list(self.layer_numel), self.store.manifest().refs()) or 0
            logger.warning("resuming the run in %s at step %d with %d workers", self.store_uri, t_fail + 1, world_size)
        with self._lock:
            self.tracker.forget_incomplete()
        try:
            resolved = resolve_plan(self.store, self.layer_numel, t_fail, deep=False, skip=self.unusable)
        except NoUsableVersionError as error:
            logger.warning("no composite to recover from (%s): training restarts from the initial weights", error)
            resolved = None
        resume_after = t_fail if resolved is not None else 0
        persisted = {layer: r.step for layer, r in resolved.records.items()} if resolved else {}
        ray.get(self.policy_actor.restart.remote(world_size, resume_after, persisted))
        with self._lock:
            recovery = self.account.failed(t_fail=t_fail, resumed_at=resume_after + 1, now=now, lost_group=lost_group)
        recovery.plan_s = time.monotonic() - now
        if resolved is not None:
            recovery.weighted_staleness = resolved.plan.weighted_staleness
            recovery.max_staleness = resolved.plan.max_staleness
            logger.info("resuming at step %d from a composite: max staleness %d, weighted %.1f",
                        resume_after + 1, resolved.plan.max_staleness, resolved.plan.weighted_staleness)
        return ResumeInfo(self._attempt, resume_after + 1, dict(resolved.records) if resolved else None)

    def loaded(self, rank: int, load_s: float) -> None:
        """A rank finished loading the composite; recovery load time is the slowest rank's."""
        with self._lock:
            if self.account.recoveries:
                last = self.account.recoveries[-1]
                last.load_s = max(last.load_s, load_s)

    def version_unusable(self, version_id: str, reason: str) -> None:
        """A rank found a version corrupt while loading it; the next recovery skips it."""
        with self._lock:
            logger.error("version %s is unusable: %s", version_id, reason)
            self.unusable[version_id] = reason

    # ---- persistence --------------------------------------------------------------------
    def shard_written(self, receipt_json: Mapping[str, Any], write_s: float) -> None:
        receipt = ShardReceipt.from_json(receipt_json)
        with self._lock:
            self.write_latencies.append(write_s)
            complete = self.tracker.add(receipt)
            if complete is None:
                return
            try:
                record = self.store.commit(complete)
            except Exception as error:  # storage trouble: keep training, keep what is committed
                self.write_failures += 1
                logger.error("commit of %s step %d failed: %s", receipt.layer, receipt.step, error)
                return
            self.tracker.committed(record.layer, record.step)
            stats = self.layers[record.layer]
            stats.versions += 1
            stats.bytes += record.nbytes
            stats.last_step = max(record.step, stats.last_step or 0)

    def write_failed(self, layer: str, step: int, rank: int, error: str) -> None:
        with self._lock:
            self.write_failures += 1

    def drain(self) -> None:
        """Wait until every handed-over snapshot is written and, where whole, committed."""
        with self._lock:
            writers = [w for ws in self._writers.values() for w in ws]
        ray.get([w.drain.remote() for w in writers])

    # ---- progress -----------------------------------------------------------------------
    def progress(self, step: int, loss: float, lr: float, compute_s: float, stall_s: float,
                 coordination_s: float = 0.0) -> None:
        """Rank 0, after each step."""
        with self._lock:
            self.account.step_done(step, compute_s, stall_s, time.monotonic(), loss=loss, lr=lr,
                                   coordination_s=coordination_s)
            self.progress_ = Progress(step=step, loss=loss, lr=lr, step_s=compute_s)
            if self._metrics is not None:
                self._metrics.step_done(step, compute_s, {n: s.last_step for n, s in self.layers.items()})

    def finish(self, ok: bool) -> None:
        with self._lock:
            self.state = State.FINISHED if ok else State.FAILED
        self._refresh_metrics()

    def writer_stats(self) -> list[WriterStats]:
        with self._lock:
            writers = [w for ws in self._writers.values() for w in ws]
        return ray.get([w.get_stats.remote() for w in writers])

    # ---- metrics ------------------------------------------------------------------------
    def start_metrics(self, host: str, port: int, refresh_s: float = 1.0) -> str:
        """Serve the run's Prometheus metrics on ``host:port`` and refresh them every
        ``refresh_s``; returns the endpoint's URL. Lives here because the supervisor outlives
        worker-group restarts, so the counters do too."""
        if self._metrics is not None:
            return self._metrics_url or ""
        metrics = RunMetrics(self.run_id, self.layer_numel)
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
            writers = ray.get([w.get_stats.remote() for w in self._all_writers()], timeout=5)
            self._metrics.refresh(status, writers, policy, time.monotonic())
        except Exception as error:  # metrics must never take the run down
            logger.warning("metrics refresh failed: %s", error)

    def flush_metrics(self) -> bool:
        """At the end of the run: refresh, and wait (briefly) until Prometheus has scraped the
        final values; True if it did. The exporter ends with this actor."""
        if self._metrics is None:
            return False
        self._refresh_metrics()
        return self._metrics.await_scrape()

    def _all_writers(self) -> list[Any]:
        with self._lock:
            return [w for ws in self._writers.values() for w in ws]

    def status(self) -> dict[str, Any]:
        """Everything the driver's progress line, the summary and the metrics show."""
        with self._lock:
            now = time.monotonic()
            step = self.progress_.step
            staleness = {name: (step - s.last_step if s.last_step is not None else None)
                         for name, s in self.layers.items()}
            known = {n: v for n, v in staleness.items() if v is not None}
            total = sum(self.layer_numel[n] for n in known)
            return {
                "run_id": self.run_id,
                "metrics_url": self._metrics_url,
                "state": self.state.value,
                "attempt": self._attempt,
                "step": step,
                "loss": self.progress_.loss,
                "lr": self.progress_.lr,
                "step_s": self.progress_.step_s,
                "staleness": staleness,
                "max_staleness": max(known.values()) if known else None,
                "weighted_staleness": (sum(self.layer_numel[n] * v for n, v in known.items()) / total)
                if known and len(known) == len(staleness) else None,
                "layers": {name: {"versions": s.versions, "bytes": s.bytes, "last_step": s.last_step}
                           for name, s in self.layers.items()},
                "bytes_committed": sum(s.bytes for s in self.layers.values()),
                "versions_committed": sum(s.versions for s in self.layers.values()),
                "abandoned_versions": self.tracker.abandoned,
                "write_failures": self.write_failures,
                "write_latencies": list(self.write_latencies),
                "account": self.account.summary(now),
            }
