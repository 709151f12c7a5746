"""The run's Prometheus metrics: :class:`RunMetrics` projects the supervisor's central view onto
the metrics :mod:`layercheck.orchestrator.runtime.metric_specs` declares.

The supervisor owns a :class:`RunMetrics` and outlives worker-group restarts, so counters stay
monotonic across them: each counter follows a monotonic total the supervisor (or a writer actor)
keeps, and is only ever advanced by the difference. Every series carries a ``run_id`` label.
Nothing is registered globally: each :class:`RunMetrics` has its own ``CollectorRegistry``, so
several runs (or tests) in one process never collide, and nothing is served until
:meth:`RunMetrics.serve` is called.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server

from layercheck.orchestrator.core.accounting import FALLBACK_REASONS
from layercheck.orchestrator.core.memory.footprint import RSS_PARTS
from layercheck.orchestrator.core.memory.reads import SOURCES
from layercheck.orchestrator.core.persistence.writer_stats import WriterStats
from layercheck.orchestrator.core.recovery.capture_window import capture_figures
from layercheck.orchestrator.core.run_status import RunStatus
from layercheck.orchestrator.runtime.metric_specs import (
    BYTES_PER_PARAM,
    RECENT_WINDOW_S,
    RECOVERY_PHASES,
    SPECS,
    STATES,
    Spec,
)

logger = logging.getLogger(__name__)


class _WithoutCreated:
    """The collectors of ``inner`` less prometheus_client's ``*_created`` timestamps (series no
    dashboard uses, which would double the counters' and histograms' series)."""

    def __init__(self, inner: CollectorRegistry, on_collect: Any) -> None:
        self.inner = inner
        self.on_collect = on_collect

    def collect(self) -> Any:
        self.on_collect()
        for family in self.inner.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


def _build(spec: Spec, registry: CollectorRegistry) -> Any:
    labels = ("run_id", *spec.labels)
    if spec.kind is Histogram:
        assert spec.buckets is not None, f"{spec.name}: a histogram's spec names its buckets"
        return Histogram(spec.name, spec.help, labels, registry=registry, buckets=spec.buckets)
    name = spec.name.removesuffix("_total") if spec.kind is Counter else spec.name
    return spec.kind(name, spec.help, labels, registry=registry)


class RunMetrics:
    """The metrics of one run. :meth:`refresh` takes the supervisor's status, the writers'
    stats and the policy's view; :meth:`step_done` is called once per step."""

    def __init__(self, run_id: str, layer_numel: Mapping[str, int], *, window_s: float = RECENT_WINDOW_S) -> None:
        self.run_id = run_id
        self.layer_numel = dict(layer_numel)
        self.window_s = window_s
        inner = CollectorRegistry(auto_describe=True)
        self.m = {spec.name: _build(spec, inner) for spec in SPECS}
        self.registry = CollectorRegistry()
        self.registry.register(_WithoutCreated(inner, self._scraped))
        self._scrape_seen = threading.Condition()
        self._scrapes = 0
        self._scrape_times: deque[float] = deque(maxlen=2)
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, ...], float] = {}  # per counter series: the total already counted
        self._latencies_seen = 0
        self._recoveries_seen = 0
        self._loaded = dict.fromkeys(SOURCES, 0)  # bytes, recoveries seen
        self._memory_writers: set[str] = set()  # writers whose memory gauges are exported
        self._rss_writers: set[str] = set()  # writers whose resident-memory gauges are exported
        self._weighted: dict[int, float] = {}  # per step since the base: weighted staleness
        self._weighted_sum = 0.0
        self._samples: deque[tuple[float, float, float]] = deque()  # (now, productive_s, written bytes)
        self._server: Any = None
        full = sum(self.layer_numel.values()) * BYTES_PER_PARAM
        self._set("layercheck_full_checkpoint_bytes", full)
        for layer, numel in self.layer_numel.items():
            self._set("layercheck_layer_parameters", numel, layer)

    # ---- serving ------------------------------------------------------------------------
    def serve(self, host: str, port: int) -> None:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread (raises if the port is taken)."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        logger.info("metrics of %s served at http://%s:%d/metrics", self.run_id, host, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _scraped(self) -> None:
        with self._scrape_seen:
            self._scrapes += 1
            self._scrape_times.append(time.monotonic())
            self._scrape_seen.notify_all()

    def await_scrape(self, cap_s: float = 30.0) -> bool:
        """Wait until the values as they are now have been scraped, so a run's final values reach
        Prometheus before the exporter ends. Two scrapes: the first to end may have begun before
        the values changed (seen under load: the final staleness never reached Prometheus). Only
        when something is scraping (two scrapes seen), and for at most three of its intervals
        plus 2 s (``cap_s`` at most). True if it was scraped."""
        with self._scrape_seen:
            if len(self._scrape_times) < 2:
                return False
            interval = self._scrape_times[1] - self._scrape_times[0]
            seen = self._scrapes
            return self._scrape_seen.wait_for(lambda: self._scrapes > seen + 1, timeout=min(cap_s, 3 * interval + 2))

    def exposition(self) -> str:
        """The text Prometheus scrapes."""
        return generate_latest(self.registry).decode()

    # ---- helpers ------------------------------------------------------------------------
    def _child(self, name: str, *labels: str) -> Any:
        return self.m[name].labels(self.run_id, *labels)

    def _set(self, name: str, value: float | None, *labels: str) -> None:
        if value is not None:
            self._child(name, *labels).set(value)

    def _advance(self, name: str, total: float, *labels: str) -> None:
        """Advance a counter to ``total``; a total that went down (a writer lost) is not undone."""
        key = (name, *labels)
        seen = self._seen.get(key, 0.0)
        if total > seen:
            self._child(name, *labels).inc(total - seen)
            self._seen[key] = total
        elif key not in self._seen:
            self._child(name, *labels)  # expose the series at 0
            self._seen[key] = seen

    # ---- per step -----------------------------------------------------------------------
    def step_done(self, step: int, compute_s: float, last_steps: Mapping[str, int | None]) -> None:
        """Rank 0 finished ``step``; ``last_steps``: each layer's newest committed step."""
        with self._lock:
            self._child("layercheck_step_duration_seconds").observe(compute_s)
            committed = {n: s for n in self.layer_numel if (s := last_steps.get(n)) is not None}
            if not last_steps or len(committed) < len(self.layer_numel):
                return
            total = sum(self.layer_numel.values())
            weighted = sum(numel * (step - committed[n]) for n, numel in self.layer_numel.items()) / total
            self._weighted_sum += weighted - self._weighted.get(step, 0.0)  # a redone step replaces its sample
            self._weighted[step] = weighted

    # ---- refresh ------------------------------------------------------------------------
    def refresh(self, status: RunStatus, writers: Sequence[WriterStats], policy: Mapping[str, Any], now: float) -> None:
        """Bring every metric up to date. ``status``: :meth:`SupervisorActor.status`; ``writers``:
        :class:`~layercheck.orchestrator.core.persistence.writer_stats.WriterStats` of every writer; ``policy``:
        :meth:`PolicyActor.metrics_view` (may be empty when the policy actor did not answer)."""
        with self._lock:
            self._refresh_layers(status, policy)
            self._refresh_staleness(status, policy)
            self._refresh_bytes(status, writers, now)
            self._refresh_schedule(policy)
            self._refresh_persistence(status, writers)
            self._refresh_host_memory(writers)
            self._refresh_recovery(status)
            self._refresh_progress(status)

    def _refresh_layers(self, status: RunStatus, policy: Mapping[str, Any]) -> None:
        for layer, stats in status.layers.items():
            self._set("layercheck_layer_staleness_steps", status.staleness.get(layer), layer)
            self._advance("layercheck_layer_committed_versions_total", stats.versions, layer)
            self._advance("layercheck_layer_committed_bytes_total", stats.bytes, layer)
        for layer, value in policy.get("accumulated", {}).items():
            self._set("layercheck_layer_accumulated_drift", value, layer)
        for layer, value in policy.get("threshold", {}).items():
            self._set("layercheck_layer_drift_threshold", value, layer)

    def _refresh_staleness(self, status: RunStatus, policy: Mapping[str, Any]) -> None:
        self._set("layercheck_staleness_max_steps", status.max_staleness)
        self._set("layercheck_staleness_weighted_steps", status.weighted_staleness)
        self._set("layercheck_smax_steps", policy.get("smax"))
        if self._weighted:
            mean = self._weighted_sum / len(self._weighted)
            interval = max(1, round(2 * mean + 1))
            full = sum(self.layer_numel.values()) * BYTES_PER_PARAM
            self._set("layercheck_staleness_weighted_mean_steps", mean)
            self._set("layercheck_full_checkpoint_interval_steps", interval)
            self._set("layercheck_full_checkpoint_equivalent_bytes", full * (status.step // interval))

    def _refresh_bytes(self, status: RunStatus, writers: Sequence[WriterStats], now: float) -> None:
        written = sum(w.written_bytes for w in writers)
        self._advance("layercheck_written_bytes_total", written)
        self._advance("layercheck_committed_bytes_total", status.bytes_committed)
        account = status.account
        self._samples.append((now, account["productive_s"], self._seen[("layercheck_written_bytes_total",)]))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()
        then, productive_then, written_then = self._samples[0]
        self._set("layercheck_ettr_ratio", account["ettr"])
        if now > then:
            # productive time drops when a failure discards the lost group's steps: count no gain then
            self._set(
                "layercheck_ettr_recent_ratio",
                min(1.0, max(0.0, account["productive_s"] - productive_then) / (now - then)),
            )
            self._set("layercheck_written_bytes_per_second", (self._samples[-1][2] - written_then) / (now - then))

    def _refresh_schedule(self, policy: Mapping[str, Any]) -> None:
        """The policy actor's ``schedule_view``: peak bytes per step, the write budget, the drain rate."""
        self._set("layercheck_peak_step_bytes", policy.get("peak_step_bytes"))
        self._set("layercheck_write_budget_bytes_per_step", policy.get("write_budget_bytes"))
        self._set("layercheck_drain_bytes_per_second", policy.get("drain_bytes_per_second"))

    def _refresh_persistence(self, status: RunStatus, writers: Sequence[WriterStats]) -> None:
        self._set("layercheck_persistence_queue_versions", sum(w.queued for w in writers))
        self._set("layercheck_persistence_queue_bytes", sum(w.queued_bytes for w in writers))
        self._advance("layercheck_superseded_versions_total", sum(w.superseded for w in writers))
        self._advance("layercheck_abandoned_versions_total", status.abandoned_versions)
        self._advance("layercheck_write_failures_total", status.write_failures)
        self._advance("layercheck_commit_retries_total", status.commit_retries)
        self._advance("layercheck_lost_versions_total", status.lost_versions)
        self._advance("layercheck_writers_replaced_total", status.writers_replaced)
        self._set("layercheck_staleness_breach", 1.0 if status.staleness_breach else 0.0)
        self._refresh_memory(writers)
        latencies = status.write_latencies
        for seconds in latencies[self._latencies_seen :]:
            self._child("layercheck_write_latency_seconds").observe(seconds)
        self._latencies_seen = max(self._latencies_seen, len(latencies))
        account = status.account
        self._advance("layercheck_stalls_total", account["stalls"])
        self._advance("layercheck_stall_seconds_total", account["stall_s"])

    def _refresh_capture(self, status: RunStatus) -> None:
        groups = capture_figures(status.account.get("capture", {}))
        self._advance("layercheck_recovery_capture_bytes_total", sum(g["bytes"] for g in groups))
        self._advance("layercheck_recovery_captured_ranks_total", sum(len(g["captured"]) for g in groups))
        self._advance("layercheck_recovery_capture_missed_ranks_total", sum(len(g["missed"]) for g in groups))
        if groups:
            last = groups[-1]
            self._set("layercheck_recovery_capture_window_seconds", last["window_s"])
            self._set("layercheck_recovery_capture_hold_seconds", last["hold_s"])
            self._set("layercheck_recovery_capture_seconds", last["capture_s"])

    def _refresh_memory(self, writers: Sequence[WriterStats]) -> None:
        """The in-memory tier: what each live writer holds (a replaced writer's series go)."""
        held = set()
        for w in writers:
            name, memory, mirror = w.name, w.memory_bytes, w.mirror_bytes
            self._set("layercheck_writer_memory_bytes", memory - mirror, name, "own")
            self._set("layercheck_writer_memory_bytes", mirror, name, "mirror")
            held.add(name)
        for name in self._memory_writers - held:
            for copy in ("own", "mirror"):
                self.m["layercheck_writer_memory_bytes"].remove(self.run_id, name, copy)
        self._memory_writers = held
        self._advance("layercheck_memory_evicted_shards_total", sum(w.memory_evicted for w in writers))

    def _refresh_host_memory(self, writers: Sequence[WriterStats]) -> None:
        """Each live writer actor's resident memory by part (a replaced writer's series go)."""
        exported = set()
        for w in writers:
            host = w.host
            parts = host.rss_parts() if host is not None else None
            if parts is None:
                continue
            name = w.name
            for part, value in parts.items():
                self._set("layercheck_writer_rss_bytes", value, name, part)
            exported.add(name)
        for name in self._rss_writers - exported:
            for part in RSS_PARTS:
                self.m["layercheck_writer_rss_bytes"].remove(self.run_id, name, part)
        self._rss_writers = exported

    def _refresh_recovery(self, status: RunStatus) -> None:
        self._refresh_capture(status)
        account = status.account
        recoveries = account["recoveries"]
        self._advance("layercheck_failures_total", account["failures"])
        self._advance("layercheck_lost_compute_seconds_total", account["lost_step_s"])
        self._advance("layercheck_steps_lost_total", sum(r["steps_redone"] for r in recoveries))
        ended = status.state in ("finished", "failed")
        # a recovery is observed once its group trained its resume step (every rank has loaded by then)
        while self._recoveries_seen < len(recoveries):
            recovery = recoveries[self._recoveries_seen]
            later = self._recoveries_seen + 1 < len(recoveries)
            if not (ended or later or (status.state == "running" and status.step >= recovery["resumed_at"])):
                break
            seconds = {**recovery.get("timeline", {}), "total": recovery["total_s"]}
            for phase in RECOVERY_PHASES:
                self._child("layercheck_recovery_seconds", phase).observe(seconds.get(phase, 0.0))
            for source in SOURCES:
                self._loaded[source] += recovery.get(f"{source}_bytes", 0)
                self._advance("layercheck_recovery_loaded_bytes_total", self._loaded[source], source)
            self._set("layercheck_recovery_composite_staleness_steps", recovery["max_staleness"], "max")
            self._set("layercheck_recovery_composite_staleness_steps", recovery["weighted_staleness"], "weighted")
            self._recoveries_seen += 1
        self._advance("layercheck_recoveries_total", self._recoveries_seen)
        in_place = sum(1 for r in recoveries[: self._recoveries_seen] if r.get("kept_processes"))
        self._advance("layercheck_recoveries_in_place_total", in_place)
        spares = status.spares or {"waiting": 0, "promotions": 0}  # none: 0 (cluster.spares = 0)
        self._set("layercheck_spares_waiting", spares["waiting"])
        self._advance("layercheck_spares_promoted_total", spares["promotions"])
        for reason in FALLBACK_REASONS:
            fell_back = sum(1 for r in recoveries[: self._recoveries_seen] if r.get("fallback") == reason)
            self._advance("layercheck_recovery_fallbacks_total", fell_back, reason)

    def _refresh_progress(self, status: RunStatus) -> None:
        self._set("layercheck_training_step", status.step)
        self._set("layercheck_step_seconds", status.step_s)
        self._set("layercheck_policy_protocol_seconds", status.account["coordination_s_per_step"]["mean"])
        engine = status.account.get("engine")
        if engine:
            self._set("layercheck_engine_info", 1, engine)
        probe = status.account.get("drift_probe")
        if probe:
            # a probe that runs the whole update in place of the optimizer's step: what it adds to that step
            per_step = probe.get("added_s_per_step", probe["s_per_step"])
            self._set("layercheck_drift_probe_seconds", per_step, probe["probe"])
        if not math.isnan(status.loss):
            self._set("layercheck_training_loss", status.loss)
        self._set("layercheck_learning_rate", status.lr)
        self._set("layercheck_worker_group_attempt", status.attempt)
        for state in STATES:
            self._set("layercheck_supervisor_state", 1.0 if status.state == state else 0.0, state)
