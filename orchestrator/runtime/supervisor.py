"""The supervisor actor: the Ray face of the run's supervision.

Ray Train (``FailureConfig``) detects a lost worker and restarts the whole group; the new group's
ranks :meth:`Supervisor.join`. What that means (a fresh start, a retried call, a lost group to
recover from at ``t_fail + 1``) and what happens to each shard receipt (commit, retry, count lost)
is decided by the Ray-free cores and carried out by :class:`~orchestrator.core.run_supervisor.RunSupervisor`;
this actor gives it Ray-backed ports (the policy actor, the writer pool), and serves the metrics.

Concurrency, by construction: ``RunSupervisor`` holds its lock only while the cores decide, never
while an action (a drain, a plan, a Ray call) runs; and the writers' calls run in their own
concurrency group (:data:`COMMIT_THREADS` threads), so joins waiting for a recovery can never take
every thread and starve the commits that recovery's drain waits for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import ray

from orchestrator.core.run_supervisor import RunSupervisor
from orchestrator.core.staleness_guard import StalenessLimits
from orchestrator.core.supervision_events import ResumeInfo, SupervisionConfig
from orchestrator.logs import configure_process_logging
from orchestrator.runtime.metrics import RunMetrics
from orchestrator.runtime.persistence_pool import WriterStats
from orchestrator.runtime.writer_pool import WriterPool
from orchestrator.store.layer_store import LayerStore
from orchestrator.store.manifest import ShardReceipt

logger = logging.getLogger(__name__)

__all__ = ["ResumeInfo", "Supervisor"]

#: How long the driver's end-of-run drain waits for the writers.
FINAL_DRAIN_S = 300.0
#: Threads for the writers' calls (commits, with their retry backoff), apart from everything else.
COMMIT_THREADS = 16


class _RayPolicy:
    """The policy actor as the supervision's :class:`~orchestrator.core.run_supervisor.PolicyPort`."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def last_complete_step(self) -> int:
        return ray.get(self.actor.last_complete_step.remote())

    def restart(self, *, world_size: int, resume_after: int, persisted_steps: Mapping[str, int]) -> None:
        ray.get(self.actor.restart.remote(world_size, resume_after, dict(persisted_steps)))

    def settled(self, layer: str, version_step: int) -> None:
        self.actor.settled.remote(layer, version_step)  # no wait: it only frees the layer for later decisions

    def request_stop(self, reason: str) -> None:
        ray.get(self.actor.request_stop.remote(reason))


@ray.remote(num_cpus=0, max_concurrency=64, concurrency_groups={"commit": COMMIT_THREADS})
class Supervisor:
    def __init__(self, *, run_id: str, store_uri: str, fsync: bool, writers_per_node: int,
                 layer_numel: Mapping[str, int], policy_actor: Any, resume: bool = False,
                 config: SupervisionConfig | None = None, limits: StalenessLimits | None = None) -> None:
        configure_process_logging()  # the actor process has no main of ours
        self.run_id = run_id
        self.layer_numel = dict(layer_numel)
        self.policy_actor = policy_actor
        self.pool = WriterPool(store_uri=store_uri, fsync=fsync, per_node=writers_per_node,
                               supervisor=ray.get_runtime_context().current_actor)
        self.run = RunSupervisor(run_id=run_id, store=LayerStore.open(store_uri, fsync=fsync), layer_numel=layer_numel,
                                 policy=_RayPolicy(policy_actor), writers=self.pool, config=config, resume=resume,
                                 limits=limits)
        self._metrics: RunMetrics | None = None
        self._metrics_url: str | None = None

    # ---- the worker group ----------------------------------------------------------------
    def join(self, rank: int, world_size: int, worker_id: str) -> ResumeInfo:
        """A rank of a (new) worker group starts; returns, once its group's recovery (if any) is
        done, the same :class:`ResumeInfo` every rank of the group gets."""
        return self.run.join(rank, world_size, worker_id)

    def writers_for(self, node_id: str) -> list[Any]:
        """The writer actors on ``node_id``; during a recovery's drain, those left after it."""
        self.run.not_draining.wait()
        return self.pool.for_node(node_id)

    def loaded(self, rank: int, load_s: float) -> None:
        """A rank finished loading the composite; recovery load time is the slowest rank's."""
        self.run.loaded(load_s)

    def version_unusable(self, version_id: str, reason: str) -> None:
        """A rank found a version corrupt while loading it; the next recovery skips it."""
        self.run.version_unusable(version_id, reason)

    def finish(self, ok: bool, reason: str = "") -> None:
        self.run.finish(ok, reason)
        self._refresh_metrics()

    # ---- persistence ---------------------------------------------------------------------
    @ray.method(concurrency_group="commit")
    def shard_written(self, receipt_json: Mapping[str, Any], write_s: float) -> None:
        self.run.shard_written(ShardReceipt.from_json(receipt_json), write_s)

    @ray.method(concurrency_group="commit")
    def write_failed(self, layer: str, step: int, rank: int, error: str) -> None:
        self.run.write_failed(layer, step)

    def writer_died(self, rank: int, node_id: str, writer: Any, lost: list[tuple[str, int]], error: str) -> list[Any]:
        """Rank ``rank`` found its writer dead (its submissions failed with the actor's death):
        replace it (once, whichever rank finds it first), count the versions the rank had in it as
        lost (each version once) so the policy may persist those layers again; the node's writers."""
        replaced = self.pool.replace_handle(writer)
        self.run.writer_died(lost=lost, reason=f"their writer died ({error.splitlines()[0][:200] if error else '?'})")
        if replaced:
            logger.warning("rank %d found its persistence writer dead; a new one takes over on node %s; "
                           "%d version(s) it held are lost", rank, node_id[:12], len(lost))
        return self.pool.for_node(node_id)

    def request_stop(self, reason: str) -> None:
        """Ask every rank to stop after the same step (the driver on Ctrl-C)."""
        self.run.request_stop(reason)

    def drain(self, timeout_s: float = FINAL_DRAIN_S) -> list[str]:
        """Wait until every handed-over snapshot is written and, where whole, committed (or
        counted lost); the writers that did not answer within ``timeout_s``."""
        unanswered = self.pool.drain(timeout_s)
        if unanswered:
            logger.error("writer(s) %s did not answer the final drain within %gs: what they hold is lost",
                         ", ".join(unanswered), timeout_s)
        return list(unanswered)

    def writer_stats(self) -> list[WriterStats]:
        return self.pool.stats()

    # ---- progress ------------------------------------------------------------------------
    def progress(self, step: int, loss: float, lr: float, compute_s: float, stall_s: float,
                 coordination_s: float = 0.0) -> None:
        """Rank 0, after each step."""
        last_steps = self.run.progress(step=step, loss=loss, lr=lr, compute_s=compute_s, stall_s=stall_s,
                                       coordination_s=coordination_s)
        if self._metrics is not None:
            self._metrics.step_done(step, compute_s, last_steps)

    def status(self) -> dict[str, Any]:
        """Everything the driver's progress line, the summary and the metrics show."""
        return self.run.status(self._metrics_url)

    # ---- metrics -------------------------------------------------------------------------
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
            self._metrics.refresh(status, self.pool.stats(timeout_s=5), policy, time.monotonic())
        except Exception as error:  # metrics must never take the run down
            logger.warning("metrics refresh failed: %s", error)

    def flush_metrics(self) -> bool:
        """At the end of the run: refresh, and wait (briefly) until Prometheus has scraped the
        final values; True if it did. The exporter ends with this actor."""
        if self._metrics is None:
            return False
        self._refresh_metrics()
        return self._metrics.await_scrape()
