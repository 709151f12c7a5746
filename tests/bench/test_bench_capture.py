"""The benchmark's survivor-capture and memory-tier strategies: a tiny 2-rank ZeRO-3 run, the last
rank lost after step 6; the survivors' slices come back exact, the lost rank's as stale as without
capture; with the memory tier every shard file of the recovery comes from the writers' memory and
the run is the storage-recovered one exactly. (Local stores: ``--store s3-loopback`` costs the
suite a moto server and slower writes, and loads the same files.) The run is the
``tiny_benchmark`` fixture's (tests/support/bench_runs.py), shared with tests/bench/test_bench_smoke.py."""

from __future__ import annotations

import math

import pytest

from layercheck.bench import report as reports
from layercheck.bench import report_text


@pytest.mark.slow
def test_capture_recovers_the_survivors_slices_exactly(tiny_benchmark):
    workload, raw, _ = tiny_benchmark
    assert raw["store"] == "local"
    results = raw["results"]
    (plain,) = results["layercheck"]["recoveries"]
    (captured,) = results["layercheck+capture"]["recoveries"]
    (rollback,) = results["full"]["recoveries"]
    lost = workload.world_size - 1
    assert plain["unsaved"]["lost_rank"] == captured["unsaved"]["lost_rank"] == lost
    # without capture every rank's slices are as old as the composite's versions
    assert plain["unsaved"]["survivors_mean_abs"] > 0
    # with it the survivor's own slices are the state at t_fail, bit for bit
    assert captured["unsaved"]["survivors_mean_abs"] == 0.0
    assert captured["unsaved"]["ranks"][0]["l1"] == 0.0
    # the lost rank's slices come from the same stored versions either way
    assert captured["unsaved"]["lost_mean_abs"] == pytest.approx(plain["unsaved"]["lost_mean_abs"], rel=1e-6)
    assert 0 < captured["unsaved"]["mean_abs"] < plain["unsaved"]["mean_abs"]
    assert rollback["unsaved"]["l1"] == 0.0  # a rollback re-runs the lost steps exactly
    assert results["layercheck+capture"]["capture_bytes"] > 0 == results["layercheck"]["capture_bytes"]
    losses = results["layercheck+capture"]["losses"]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses.values())
    # the memory tier: the same state, every byte of it from the writers' memory, none from storage
    (from_memory,) = results["layercheck+capture+memory"]["recoveries"]
    assert from_memory["unsaved"] == captured["unsaved"]
    assert results["layercheck+capture+memory"]["losses"] == losses
    assert captured["sources"]["storage_shards"] > 0 and captured["sources"]["memory_local_shards"] == 0
    assert from_memory["sources"]["storage_shards"] == 0 and from_memory["sources"]["memory_rejected"] == 0
    assert from_memory["sources"]["memory_local_bytes"] == captured["sources"]["storage_bytes"]
    # memory versions every 3 steps: one at t_fail = 6, so the lost rank's slices come back exact too
    (versions,) = results["layercheck+capture+memory@3"]["recoveries"]
    assert captured["unsaved"]["lost_mean_abs"] > 0
    assert versions["unsaved"]["lost_mean_abs"] == 0.0 and versions["unsaved"]["mean_abs"] == 0.0
    assert results["layercheck+capture+memory@3"]["bytes_written"] == results["layercheck+capture"]["bytes_written"]
    report = reports.build_report(raw, workload.to_json(), {"nproc": 2})
    memory_row = report["strategies"]["layercheck+capture+memory"]
    assert memory_row["loaded_memory_share"] == 1.0 and memory_row["load_storage_twin"] == "layercheck+capture"
    assert "layercheck+capture+memory" in report_text.text(report)
    row = report["strategies"]["layercheck+capture"]
    assert row["unsaved_at_recovery_vs_layercheck"] == pytest.approx(
        captured["unsaved"]["mean_abs"] / plain["unsaved"]["mean_abs"]
    )
    assert "layercheck+capture" in report_text.text(report)
