"""RunMetrics with plain values: names follow Prometheus conventions, every series has the run's
label, counters never go down across a worker-group restart, and the exporter serves over HTTP."""

import dataclasses
import re
import threading
import urllib.request

import pytest
from prometheus_client import Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from layercheck.orchestrator.core.memory.footprint import RSS_PARTS, FootprintMeter, HeldByKind, ProcessMemory
from layercheck.orchestrator.core.persistence.writer_stats import WriterStats
from layercheck.orchestrator.core.run_status import LayerFigures
from layercheck.orchestrator.runtime.metric_specs import BYTES_PER_PARAM, METRIC_NAMES, SPECS, STATES, series_names
from layercheck.orchestrator.runtime.metrics import RunMetrics
from layercheck.workers.env import free_port
from tests.support.statuses import a_status

NUMEL = {"embed": 400, "block.0": 300, "block.1": 300}
MiB = 2**20
POLICY = {
    "lr": 1e-3,
    "smax": 4,
    "accumulated": {"embed": 0.01, "block.0": 0.002, "block.1": 0.0},
    "threshold": {"embed": 0.05, "block.0": 0.005, "block.1": 0.005},
    "peak_step_bytes": 4800,
    "write_budget_bytes": 2000,
    "drain_bytes_per_second": 25000.0,
}


def status(
    step=10,
    *,
    last=(8, 9, 10),
    failures=0,
    recoveries=(),
    productive=5.0,
    state="running",
    latencies=(0.01, 0.02),
    committed=1200,
    stalls=0,
    stall_s=0.0,
    lost_s=0.0,
):
    layers = {n: LayerFigures(versions=2, bytes=committed // 3, last_step=s) for n, s in zip(NUMEL, last)}
    staleness = {n: step - s for n, s in zip(NUMEL, last)}
    return a_status(
        run_id="r1",
        state=state,
        attempt=1 + failures,
        step=step,
        loss=2.5,
        lr=1e-3,
        step_s=0.1,
        staleness=staleness,
        max_staleness=max(staleness.values()),
        weighted_staleness=sum(NUMEL[n] * v for n, v in staleness.items()) / sum(NUMEL.values()),
        layers=layers,
        bytes_committed=committed,
        versions_committed=6,
        write_latencies=list(latencies),
        account={
            "wall_s": 10.0,
            "productive_s": productive,
            "stall_s": stall_s,
            "stalls": stalls,
            "lost_step_s": lost_s,
            "failures": failures,
            "recoveries": list(recoveries),
            "ettr": 0.5,
            "coordination_s_per_step": {"mean": 0.003, "p50": 0.002, "p90": 0.005, "max": 0.01},
            "drift_probe": {"probe": "snapshot_diff", "s_per_step": 0.0004, "s_per_measured_step": 0.004},
            "engine": "fsdp2",
        },
    )


def samples(metrics):
    out = {}
    for family in text_string_to_metric_families(metrics.exposition()):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "run_id")))] = s
    return out


def value(metrics, name, **labels):
    return samples(metrics)[(name, tuple(sorted(labels.items())))].value


def host_footprint(anon_mib: int = 700):
    """A writer actor's host-memory account: 300 MiB runtime, 320 MiB held, 20 MiB serialising."""
    reads = iter(
        [
            ProcessMemory(rss_bytes=0, anon_bytes=200 * MiB, file_bytes=100 * MiB, shmem_bytes=0),
            ProcessMemory(rss_bytes=0, anon_bytes=anon_mib * MiB, file_bytes=100 * MiB, shmem_bytes=500 * MiB),
        ]
    )
    held = HeldByKind(memory_version_bytes=290 * MiB, stored_copy_bytes=30 * MiB)
    return FootprintMeter(lambda: next(reads)).measure(
        held, encoding_bytes=20 * MiB, capture_copy_bytes=0, object_store_bytes=40 * MiB, mirror_sending_bytes=0
    )


def test_a_writers_resident_memory_is_exported_by_part_and_goes_with_the_writer():
    metrics = RunMetrics("r1", NUMEL)
    metrics.refresh(status(), [WriterStats(name="w0", host=host_footprint()), WriterStats(name="w1")], POLICY, now=1.0)
    parts = {part: value(metrics, "layercheck_writer_rss_bytes", writer="w0", part=part) for part in RSS_PARTS}
    assert parts == {
        "runtime": 300 * MiB,
        "memory_versions": 290 * MiB,
        "stored_copies": 30 * MiB,
        "mirrors": 0,
        "in_flight": 20 * MiB,
        "unaccounted": 160 * MiB,
        "object_store": 500 * MiB,
    }
    assert sum(parts.values()) == (700 + 100 + 500) * MiB  # the process's RSS
    assert not [k for k in samples(metrics) if k[0] == "layercheck_writer_rss_bytes" and ("writer", "w1") in k[1]]
    metrics.refresh(status(), [WriterStats(name="w1")], POLICY, now=2.0)  # w0 replaced: its series go
    assert not [k for k in samples(metrics) if k[0] == "layercheck_writer_rss_bytes"]


def test_metric_names_follow_prometheus_conventions():
    assert len(set(METRIC_NAMES)) == len(METRIC_NAMES)
    for spec in SPECS:
        assert re.fullmatch(r"layercheck_[a-z0-9_]+", spec.name), spec.name
        assert spec.name.endswith("_total") == (spec.kind is Counter), spec.name
        if spec.kind is Histogram:
            assert spec.name.endswith("_seconds"), spec.name
        assert "run_id" not in spec.labels and spec.help


def test_every_series_carries_the_run_id_and_an_exported_name():
    metrics = RunMetrics("r1", NUMEL)
    metrics.step_done(10, 0.1, {"embed": 8, "block.0": 9, "block.1": 10})
    writer = WriterStats(name="w0", written_bytes=1200, queued=1, queued_bytes=100, host=host_footprint())
    for now in (1.0, 2.0):  # the recent-window gauges need two refreshes
        metrics.refresh(status(), [writer], POLICY, now=now)
    exported = set()
    for family in text_string_to_metric_families(metrics.exposition()):
        for s in family.samples:
            assert s.labels["run_id"] == "r1", s
            exported.add(s.name)
    assert exported <= series_names()
    # everything is exported once a run has made progress (histograms observed)
    assert {n for n in METRIC_NAMES if not n.startswith("layercheck_recovery")} <= {
        n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for n in exported
    }


def test_values_reflect_the_central_view():
    metrics = RunMetrics("r1", NUMEL)
    metrics.step_done(10, 0.1, {"embed": 8, "block.0": 9, "block.1": 10})
    metrics.refresh(
        status(), [WriterStats(written_bytes=1200, queued=2, queued_bytes=300, superseded=1)], POLICY, now=1.0
    )
    assert value(metrics, "layercheck_layer_staleness_steps", layer="embed") == 2
    assert value(metrics, "layercheck_staleness_max_steps") == 2
    assert value(metrics, "layercheck_staleness_weighted_steps") == pytest.approx((400 * 2 + 300 * 1) / 1000)
    assert value(metrics, "layercheck_smax_steps") == 4
    assert value(metrics, "layercheck_layer_drift_threshold", layer="block.0") == 0.005
    assert value(metrics, "layercheck_layer_accumulated_drift", layer="embed") == 0.01
    assert value(metrics, "layercheck_full_checkpoint_bytes") == 1000 * BYTES_PER_PARAM
    # mean weighted staleness 1.1 -> a full checkpoint every round(3.2) = 3 steps -> 3 by step 10
    assert value(metrics, "layercheck_full_checkpoint_interval_steps") == 3
    assert value(metrics, "layercheck_full_checkpoint_equivalent_bytes") == 3 * 1000 * BYTES_PER_PARAM
    assert value(metrics, "layercheck_persistence_queue_versions") == 2
    assert value(metrics, "layercheck_persistence_queue_bytes") == 300
    assert value(metrics, "layercheck_superseded_versions_total") == 1
    assert value(metrics, "layercheck_write_latency_seconds_count") == 2
    assert value(metrics, "layercheck_supervisor_state", state="running") == 1
    assert sum(value(metrics, "layercheck_supervisor_state", state=s) for s in STATES) == 1
    assert value(metrics, "layercheck_policy_protocol_seconds") == 0.003
    assert value(metrics, "layercheck_drift_probe_seconds", probe="snapshot_diff") == 0.0004
    assert value(metrics, "layercheck_engine_info", engine="fsdp2") == 1
    assert value(metrics, "layercheck_peak_step_bytes") == 4800
    assert value(metrics, "layercheck_write_budget_bytes_per_step") == 2000
    assert value(metrics, "layercheck_drain_bytes_per_second") == 25000.0


def test_a_probe_run_in_place_of_the_optimizers_step_shows_what_it_adds_to_that_step():
    """``optimizer (fused)`` and ``fused (in place of your AdamW)`` time the whole update; the gauge
    shows it less the optimizer's own step, as the summary does (``ProbeAccount``)."""
    metrics = RunMetrics("r1", NUMEL)
    metrics.step_done(10, 0.1, {"embed": 8, "block.0": 9, "block.1": 10})
    fused = {"probe": "optimizer (fused)", "s_per_step": 0.0007, "s_per_measured_step": 0.007}
    fused |= {"s_per_own_step": 0.005, "added_s_per_measured_step": 0.002, "added_s_per_step": 0.0002}
    run = status()
    run = dataclasses.replace(run, account={**run.account, "drift_probe": fused})
    metrics.refresh(run, [WriterStats()], POLICY, now=1.0)
    assert value(metrics, "layercheck_drift_probe_seconds", probe="optimizer (fused)") == 0.0002


def test_counters_stay_monotonic_across_a_worker_group_restart():
    metrics = RunMetrics("r1", NUMEL)
    writers = [WriterStats(written_bytes=1200)]
    metrics.refresh(status(productive=5.0, stalls=2, stall_s=0.5), writers, POLICY, now=1.0)
    recovery = {
        "t_fail": 10,
        "resumed_at": 11,
        "detect_restart_s": 11.0,
        "plan_s": 0.2,
        "load_s": 0.3,
        "total_s": 11.5,
        "weighted_staleness": 1.5,
        "max_staleness": 3,
        "steps_redone": 0,
    }
    # the group is lost: productive time of its late steps is discarded, the new group is loading
    metrics.refresh(
        status(
            step=10,
            productive=4.8,
            failures=1,
            recoveries=[recovery],
            state="running",
            stalls=2,
            stall_s=0.5,
            lost_s=0.2,
        ),
        writers,
        {},
        now=2.0,
    )
    assert value(metrics, "layercheck_failures_total") == 1
    assert value(metrics, "layercheck_recoveries_total") == 0  # not yet trained past the resume step
    assert value(metrics, "layercheck_ettr_recent_ratio") == 0.0  # lost time is no gain, never negative
    # a writer actor restarted with fresh stats: the counter does not go back
    metrics.refresh(
        status(
            step=12,
            productive=5.0,
            failures=1,
            recoveries=[recovery],
            stalls=3,
            stall_s=0.7,
            lost_s=0.2,
            committed=1500,
        ),
        [WriterStats(written_bytes=10)],
        POLICY,
        now=3.0,
    )
    assert value(metrics, "layercheck_recoveries_total") == 1
    assert value(metrics, "layercheck_recovery_seconds_count", phase="load") == 1
    assert value(metrics, "layercheck_recovery_seconds_sum", phase="total") == 11.5
    assert value(metrics, "layercheck_recovery_composite_staleness_steps", aggregation="max") == 3
    assert value(metrics, "layercheck_written_bytes_total") == 1200
    assert value(metrics, "layercheck_committed_bytes_total") == 1500
    assert value(metrics, "layercheck_stalls_total") == 3
    assert value(metrics, "layercheck_stall_seconds_total") == pytest.approx(0.7)
    assert value(metrics, "layercheck_lost_compute_seconds_total") == pytest.approx(0.2)
    metrics.refresh(status(step=12, failures=1, recoveries=[recovery], state="finished"), [], POLICY, now=4.0)
    assert value(metrics, "layercheck_recoveries_total") == 1  # each recovery is observed once
    assert value(metrics, "layercheck_recoveries_in_place_total") == 0
    assert value(metrics, "layercheck_recovery_fallbacks_total", reason="no_survivor") == 0
    assert value(metrics, "layercheck_supervisor_state", state="finished") == 1


def test_an_in_place_runs_recoveries_are_counted_by_path_and_its_full_restarts_by_why():
    metrics = RunMetrics("r1", NUMEL)
    base = {"t_fail": 1, "detect_restart_s": 1.0, "plan_s": 0.1, "load_s": 0.1, "total_s": 2.0}
    base |= {"weighted_staleness": 0.0, "max_staleness": 0, "steps_redone": 0}
    recoveries = [
        {**base, "resumed_at": 2, "kept_processes": 1, "fallback": ""},
        {**base, "resumed_at": 3, "kept_processes": 0, "fallback": "no_survivor"},
        {**base, "resumed_at": 4, "kept_processes": 0, "fallback": "recovery_failed"},
    ]
    finished = status(step=5, failures=3, recoveries=recoveries, state="finished")
    finished = dataclasses.replace(finished, spares={"spares": 1, "waiting": 1, "promotions": 1})
    metrics.refresh(finished, [], POLICY, now=1.0)
    assert value(metrics, "layercheck_spares_waiting") == 1 and value(metrics, "layercheck_spares_promoted_total") == 1
    assert value(metrics, "layercheck_recoveries_total") == 3
    assert value(metrics, "layercheck_recoveries_in_place_total") == 1
    assert value(metrics, "layercheck_recovery_fallbacks_total", reason="no_survivor") == 1
    assert value(metrics, "layercheck_recovery_fallbacks_total", reason="recovery_failed") == 1
    assert value(metrics, "layercheck_recovery_fallbacks_total", reason="rank_failed") == 0


def test_a_redone_step_replaces_its_staleness_sample():
    metrics = RunMetrics("r1", {"a": 1})
    for step in (1, 2, 3):
        metrics.step_done(step, 0.1, {"a": 0})
    metrics.step_done(3, 0.1, {"a": 3})  # step 3 trained again after a recovery, from a fresh version
    metrics.refresh(status(step=3, last=(0, 0, 0)), [], {}, now=1.0)
    assert value(metrics, "layercheck_staleness_weighted_mean_steps") == pytest.approx((1 + 2 + 0) / 3)


def test_two_runs_in_one_process_do_not_collide_and_serve_over_http():
    port = free_port()
    first, second = RunMetrics("r1", NUMEL), RunMetrics("r2", NUMEL)
    first.serve("127.0.0.1", port)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        first.close()
    assert 'layercheck_full_checkpoint_bytes{run_id="r1"} 12000.0' in body
    assert "r2" not in body and 'run_id="r2"' in second.exposition()


def test_the_final_values_wait_for_two_scrapes_only_when_something_scrapes():
    metrics = RunMetrics("r1", NUMEL)
    assert metrics.await_scrape() is False  # nobody scraping: the run does not wait
    metrics.exposition()
    metrics.exposition()  # a scraper polls...
    metrics._scrape_times.extend([0.0, 3600.0])  # ...every hour, say: the wait is bounded by cap_s alone
    # the first scrape to end may have begun before the final values: the second one surely did not
    scrapers = [threading.Timer(delay, metrics.exposition) for delay in (0.05, 0.1)]
    for scraper in scrapers:
        scraper.start()
    assert metrics.await_scrape(cap_s=60) is True  # ...and the final values are scraped
    for scraper in scrapers:
        scraper.join()
