"""Every metric a LayerCheck run exports, in one table (:data:`SPECS`): name, kind, help text
and labels. :class:`~layercheck.orchestrator.runtime.metrics.RunMetrics` builds and sets them; the
dashboards and alert rules may use only these names (``tests/orchestrator/runtime/test_dashboards.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from layercheck.orchestrator.core.accounting import FALLBACK_REASONS
from layercheck.orchestrator.core.accounting import RECOVERY_PHASES as TIMELINE_PHASES
from layercheck.orchestrator.core.recovery.state_machine import STATE_NAMES
from layercheck.policies.staggered import (
    BYTES_PER_PARAM,
)  # fp32 weight + Adam exp_avg + exp_avg_sq: a full checkpoint's

#: The window of the "recent" gauges (ETTR, bytes per second).
RECENT_WINDOW_S = 60.0
#: The supervisor's states, exported as one 0/1 series each (see :mod:`layercheck.orchestrator.core.recovery.state_machine`).
STATES = STATE_NAMES
#: A recovery's phases (``accounting.RECOVERY_PHASES``) and its total, failure to next step.
RECOVERY_PHASES = (*TIMELINE_PHASES, "total")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class Spec:
    """One exported metric. ``name`` is the name Prometheus sees (counters end in ``_total``)."""

    kind: type
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


_LAYER = ("layer",)
SPECS: tuple[Spec, ...] = (
    # ---- per layer ---------------------------------------------------------------------
    Spec(
        Gauge,
        "layercheck_layer_staleness_steps",
        "Steps since the layer's newest committed version was taken (unset before the base).",
        _LAYER,
    ),
    Spec(
        Gauge,
        "layercheck_layer_accumulated_drift",
        "The policy's accumulated drift D of the layer since it was last persisted.",
        _LAYER,
    ),
    Spec(
        Gauge,
        "layercheck_layer_drift_threshold",
        "The policy's current threshold K0 * s(lr) for the layer, at the latest step's learning rate.",
        _LAYER,
    ),
    Spec(Counter, "layercheck_layer_committed_versions_total", "Versions of the layer committed to the store.", _LAYER),
    Spec(Counter, "layercheck_layer_committed_bytes_total", "Bytes of the layer's committed versions.", _LAYER),
    Spec(Gauge, "layercheck_layer_parameters", "Trainable parameters of the layer.", _LAYER),
    # ---- staleness ---------------------------------------------------------------------
    Spec(Gauge, "layercheck_staleness_max_steps", "The largest staleness of any layer."),
    Spec(
        Gauge,
        "layercheck_staleness_weighted_steps",
        "Parameter-weighted mean staleness over the layers (unset until every layer has a version).",
    ),
    Spec(
        Gauge,
        "layercheck_staleness_weighted_mean_steps",
        "The parameter-weighted staleness averaged over the steps since every layer had a version.",
    ),
    Spec(
        Gauge,
        "layercheck_smax_steps",
        "The staleness budget Smax of the LayerCheck policy (the interval of the interval baseline).",
    ),
    # ---- bytes -------------------------------------------------------------------------
    Spec(Counter, "layercheck_written_bytes_total", "Bytes of layer shards the writers wrote to the store."),
    Spec(
        Gauge,
        "layercheck_written_bytes_per_second",
        f"Bytes of layer shards written per second over the last {RECENT_WINDOW_S:.0f} s "
        "(the counter's rate() gives the same from Prometheus).",
    ),
    Spec(Counter, "layercheck_committed_bytes_total", "Bytes of all committed layer versions (base included)."),
    Spec(
        Gauge,
        "layercheck_full_checkpoint_bytes",
        f"Bytes of one full checkpoint: {BYTES_PER_PARAM} bytes per parameter (fp32 weight and two Adam moments).",
    ),
    Spec(
        Gauge,
        "layercheck_full_checkpoint_equivalent_bytes",
        "Bytes fixed-interval full checkpoints would have written by the current step at the same freshness: "
        "layercheck_full_checkpoint_bytes * floor(step / I), I = layercheck_full_checkpoint_interval_steps.",
    ),
    Spec(
        Gauge,
        "layercheck_full_checkpoint_interval_steps",
        "The full-checkpoint interval with the run's freshness: I = max(1, round(2 * S + 1)), S = "
        "layercheck_staleness_weighted_mean_steps (a full checkpoint every I steps has mean staleness (I - 1) / 2).",
    ),
    Spec(
        Gauge,
        "layercheck_peak_step_bytes",
        "The most bytes one step's decision handed over so far (the layers saved at that step, 12 bytes per "
        "parameter; the run's final save excluded); beside layercheck_full_checkpoint_bytes, a full checkpoint's.",
    ),
    Spec(
        Gauge,
        "layercheck_write_budget_bytes_per_step",
        "The schedule's write budget: headroom * the writers' drain bandwidth * the step time, capped "
        "(persistence.write_budget; unset until a write finished or when disabled).",
    ),
    Spec(
        Gauge,
        "layercheck_drain_bytes_per_second",
        "The writers' measured drain bandwidth (bytes per second of writing, summed over the writers) "
        "behind the write budget.",
    ),
    # ---- persistence -------------------------------------------------------------------
    Spec(Gauge, "layercheck_persistence_queue_versions", "Layer shards handed to the writers and not yet written."),
    Spec(Gauge, "layercheck_persistence_queue_bytes", "Bytes of layer shards handed to the writers, not yet written."),
    Spec(
        Histogram,
        "layercheck_write_latency_seconds",
        "Time a writer took to write one layer shard.",
        buckets=_LATENCY_BUCKETS,
    ),
    Spec(
        Counter,
        "layercheck_superseded_versions_total",
        "Queued shards replaced by a newer snapshot of the same layer before they were written.",
    ),
    Spec(
        Counter,
        "layercheck_abandoned_versions_total",
        "Versions dropped incomplete (a newer one completed first, or the worker group was lost).",
    ),
    Spec(Counter, "layercheck_write_failures_total", "Shard writes that failed."),
    Spec(Counter, "layercheck_commit_retries_total", "Version commits tried again after a failure."),
    Spec(
        Counter,
        "layercheck_lost_versions_total",
        "Versions never committed for want of storage (commit retries exhausted) or of a writer (drain timed out).",
    ),
    Spec(
        Counter,
        "layercheck_recovery_capture_bytes_total",
        "Bytes survivors of broken worker groups handed to their writers (their capture of every layer they hold).",
    ),
    Spec(Counter, "layercheck_recovery_captured_ranks_total", "Survivors whose capture their writer holds."),
    Spec(
        Counter,
        "layercheck_recovery_capture_missed_ranks_total",
        "Survivors that did not capture in time (stuck in a collective, gone, or over capture_timeout_s).",
    ),
    Spec(
        Gauge,
        "layercheck_recovery_capture_window_seconds",
        "The last broken group: seconds from a survivor's step raising to Ray Train's teardown (what "
        "survivors would have had without LayerCheck's hold).",
    ),
    Spec(
        Gauge,
        "layercheck_recovery_capture_hold_seconds",
        "The last broken group: seconds its teardown was held for the survivors' captures.",
    ),
    Spec(
        Gauge,
        "layercheck_recovery_capture_seconds",
        "The last broken group: the slowest survivor's capture (step raised to the writer holding it).",
    ),
    Spec(
        Counter,
        "layercheck_writers_replaced_total",
        "Persistence writer actors found dead and replaced (what each held is counted in lost versions).",
    ),
    Spec(
        Gauge,
        "layercheck_staleness_breach",
        "1 once storage failures, or storage that does not answer (persistence.hung_write_s), let a layer's "
        "staleness pass Smax plus the pipeline lag (the run's bound is broken; persistence.on_staleness_breach "
        "says whether it stops), else 0.",
    ),
    Spec(
        Gauge,
        "layercheck_writer_memory_bytes",
        "Shard-file bytes a persistence writer holds in host memory for recovery, within persistence.memory_bytes "
        "(copy: own, the files it wrote; mirror, another node's writer's).",
        ("writer", "copy"),
    ),
    Spec(
        Gauge,
        "layercheck_writer_rss_bytes",
        "A persistence writer process's resident memory by part; the parts sum to its RSS. runtime: the idle "
        "process (Ray worker, torch, pyarrow), measured at its start; memory_versions, stored_copies, mirrors: "
        "shard files it holds within persistence.memory_bytes; in_flight: copies on their way to being held or "
        "written (serialised files, survivors' captures); unaccounted: the rest of its own memory; object_store: "
        "Ray object-store pages it has read, shared memory of the node's object store (not the writer's own).",
        ("writer", "part"),
    ),
    Spec(
        Counter,
        "layercheck_memory_evicted_shards_total",
        "Shard files the writers let go of to stay within persistence.memory_bytes (still recoverable from storage).",
    ),
    Spec(Counter, "layercheck_stalls_total", "Steps in which the training loop waited to hand snapshots over."),
    Spec(Counter, "layercheck_stall_seconds_total", "Seconds the training loop waited to hand snapshots over."),
    # ---- failures and recovery ---------------------------------------------------------
    Spec(Counter, "layercheck_failures_total", "Worker groups lost (fail-stop failures)."),
    Spec(
        Counter, "layercheck_recoveries_total", "Recoveries completed: a new worker group trained past its resume step."
    ),
    Spec(
        Counter,
        "layercheck_recoveries_in_place_total",
        "Recoveries completed in place (cluster.in_place): the survivors kept their processes; the others "
        "were full restarts.",
    ),
    Spec(
        Gauge,
        "layercheck_spares_waiting",
        "Warm spares (cluster.spares) built and waiting to take a lost rank's place; each holds a worker's "
        "resources idle.",
    ),
    Spec(Counter, "layercheck_spares_promoted_total", "Warm spares promoted to a lost rank's place."),
    Spec(
        Counter,
        "layercheck_recovery_fallbacks_total",
        "Recoveries of a run that asked for in place (cluster.in_place) that were full restarts, by why: "
        + ", ".join(f"{reason} ({said})" for reason, said in FALLBACK_REASONS.items())
        + ".",
        ("reason",),
    ),
    Spec(
        Histogram,
        "layercheck_recovery_seconds",
        "Recovery time by phase, failure to the next completed step: restart (the failure noticed, the lost "
        "workers torn down, new processes scheduled: the rest of the total), start (their imports, Ray Train's "
        "context), group (the process group formed again, in place), build (the engine; the plan runs "
        "meanwhile), plan (drain writers, plan the composite), load (slowest rank's), first_step (the first "
        "step after the load), total (failure to next step).",
        ("phase",),
        _RECOVERY_BUCKETS,
    ),
    Spec(
        Counter,
        "layercheck_steps_lost_total",
        "Steps trained again after a recovery (0 when it resumes at t_fail + 1).",
    ),
    Spec(
        Counter,
        "layercheck_lost_compute_seconds_total",
        "Compute of steps a lost worker group finished that did not count (after t_fail).",
    ),
    Spec(
        Counter,
        "layercheck_recovery_loaded_bytes_total",
        "Shard-file bytes recovering ranks loaded, by source: memory_local (a writer on the rank's node), "
        "memory_remote (a writer on another node), storage.",
        ("source",),
    ),
    Spec(
        Gauge,
        "layercheck_recovery_composite_staleness_steps",
        "Staleness of the composite the last recovery loaded (aggregation: max or weighted).",
        ("aggregation",),
    ),
    # ---- time --------------------------------------------------------------------------
    Spec(Gauge, "layercheck_ettr_ratio", "Effective training time ratio: productive step time / wall-clock time."),
    Spec(
        Gauge,
        "layercheck_ettr_recent_ratio",
        f"ETTR over the last {RECENT_WINDOW_S:.0f} s: productive step time gained / wall-clock time.",
    ),
    Spec(Gauge, "layercheck_step_seconds", "Compute time of the latest step (rank 0)."),
    Spec(
        Histogram, "layercheck_step_duration_seconds", "Compute time of each step (rank 0).", buckets=_LATENCY_BUCKETS
    ),
    Spec(
        Gauge,
        "layercheck_policy_protocol_seconds",
        "Rank 0's mean time per step in the policy protocol (drift report + decision), on the critical path.",
    ),
    Spec(
        Gauge,
        "layercheck_drift_probe_seconds",
        "Rank 0's drift probe: its own work per step, mean over the run (on a GPU, device time); for a "
        "probe that runs the whole update in place of the optimizer's step, what it adds to that step.",
        ("probe",),
    ),
    Spec(Gauge, "layercheck_engine_info", "1 for the training engine the ranks run (deepspeed, fsdp2).", ("engine",)),
    Spec(Gauge, "layercheck_training_step", "The latest step rank 0 completed."),
    Spec(Gauge, "layercheck_training_loss", "Loss of the latest step."),
    Spec(Gauge, "layercheck_learning_rate", "Learning rate of the latest step."),
    Spec(Gauge, "layercheck_worker_group_attempt", "The worker group's attempt (1, then +1 per restart)."),
    Spec(Gauge, "layercheck_supervisor_state", "1 for the supervisor's current state, 0 for the others.", ("state",)),
)

#: Every metric name the code exports, as Prometheus sees it.
METRIC_NAMES: tuple[str, ...] = tuple(spec.name for spec in SPECS)


def series_names() -> frozenset[str]:
    """Every series name a query may use: the metric names plus the histograms' sample names."""
    names = set(METRIC_NAMES)
    for spec in SPECS:
        if spec.kind is Histogram:
            names |= {f"{spec.name}_bucket", f"{spec.name}_sum", f"{spec.name}_count"}
    return frozenset(names)
