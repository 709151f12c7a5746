"""Smoke test of the benchmark harness: real DeepSpeed ranks, a few steps, one failure. The run is
the ``tiny_benchmark`` fixture's (tests/support/bench_runs.py), shared with tests/bench/test_bench_capture.py."""

from __future__ import annotations

import json
import math

import pytest

from layercheck.bench import report as reports
from layercheck.bench.cli import write_outputs
from layercheck.orchestrator.cli.main import main
from tests.support.bench_runs import TINY_BENCHMARK_STRATEGIES


@pytest.mark.slow
def test_harness_runs_recovers_and_reports(tiny_benchmark, tmp_path):
    workload, raw, partial = tiny_benchmark  # no root: each store is deleted after its run
    results = raw["results"]
    assert list(results) == ["none", *TINY_BENCHMARK_STRATEGIES]
    assert {"layercheck", "full", "diff", "full-resume"} <= set(results)
    # full-resume commits the state after step 5 (decided at 4): freshness counts it although the
    # store is gone by the time the report is made (staleness 2, 3, 4, 0, 1, then 2, 0 after the recovery)
    assert results["full-resume"]["freshness"]["max_staleness"] == 4
    assert results["full-resume"]["handed_state_bytes"]["peak_step"] == raw["params"] * 12
    for name, result in results.items():
        losses = result["losses"]
        assert len(losses) == 8 and all(math.isfinite(v) for v in losses.values()), name
        # before the failure every strategy trains exactly like the reference
        assert [losses[str(s)] for s in range(1, 7)] == [results["none"]["losses"][str(s)] for s in range(1, 7)]
    (lc_recovery,) = results["layercheck"]["recoveries"]
    assert lc_recovery["resume_after"] == 6 and lc_recovery["steps_lost"] == 0
    (full_recovery,) = results["full"]["recoveries"]
    assert full_recovery["resume_after"] == 4 and full_recovery["steps_lost"] == 2
    assert full_recovery["replay_max_loss_diff"] == 0.0  # re-running the lost steps is exact
    (diff_recovery,) = results["diff"]["recoveries"]  # the full taken after step 5 (decided at 4) + a delta
    assert diff_recovery["resume_after"] == 6 and diff_recovery["steps_lost"] == 0
    assert results["layercheck"]["bytes_written"] > 0 and results["full"]["bytes_written"] > 0
    # every strategy measures drift (the freshness figures need it): its own work inside the steps
    assert all(result["probe_work_s"] > 0 for result in results.values()), results
    report = reports.build_report(raw, workload.to_json(), {"nproc": 2})
    write_outputs(report, tmp_path / "out", ettr_runs=5)
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"bench.json", "summary.md", "ettr.json", "ettr.png"}

    # the results as rewritten after each strategy: after the last, every strategy's, and a run
    # cut short is reported from them as from a bench.json
    document = json.loads(partial.read_text())
    assert document["partial"] is True and document["workload"] == workload.to_json()
    assert document["raw"]["results"] == json.loads(json.dumps(results))
    assert main(["bench", "--rebuild", str(partial), "--out", str(tmp_path / "rebuilt"), "--json"]) == 0
    rebuilt = json.loads((tmp_path / "rebuilt" / "bench.json").read_text())
    for name, row in report["strategies"].items():
        assert rebuilt["strategies"][name]["bytes_written"] == row["bytes_written"], name
        assert rebuilt["strategies"][name]["recovery_s"] == row["recovery_s"], name
