"""The scale harness's figures in the cluster model (issue 59): a ``scale.json`` as per-N costs
(``bench/scale/costs.py``), charged to LayerCheck's strategies at each GPU count of the ETTR grid,
and ``layercheck ettr --scale`` as a user runs it."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from layercheck.bench import ettr
from layercheck.bench.ettr import Costs
from layercheck.bench.scale.costs import BELOW, EXTRAPOLATED, INTERPOLATED, MEASURED, scale_costs, take

BENCH = Path(__file__).resolve().parents[2] / "bench" / "results" / "cpu-default" / "bench.json"


def _report() -> dict:
    """A small hand-made ``scale.json``: three rows (the last without a failure, so without a plan;
    the first's latency unmeasured) and two long histories planned at 8 ranks."""
    return {
        "config": {"step_s": 1.0},
        "rows": [
            {"n_ranks": 8, "control_cpu_ms_per_step": 40.0, "plan_s": 0.2, "decision_latency_ms": {"median": math.nan}},
            {"n_ranks": 64, "control_cpu_ms_per_step": 200.0, "plan_s": 0.4, "decision_latency_ms": {"median": 30.0}},
            {"n_ranks": 256, "control_cpu_ms_per_step": 600.0, "plan_s": None, "decision_latency_ms": {"median": 90.0}},
        ],
        "plan_many": [
            {"versions": 1_000, "n_ranks": 8, "kept_plan_s": 0.3},
            {"versions": 100_000, "n_ranks": 8, "kept_plan_s": 1.2},
        ],
    }


def test_a_figure_is_measured_interpolated_held_or_extrapolated_linearly():
    points = [(8, 1.0), (64, 8.0), (256, 10.0)]
    assert take(points, 64).value == 8.0 and take(points, 64).how == MEASURED
    between = take(points, 36)
    assert (between.value, between.how, between.rows) == (4.5, INTERPOLATED, (8, 64))
    assert (take(points, 2).value, take(points, 2).how) == (1.0, BELOW)  # a cost does not fall below its fixed part
    past = take(points, 1024)  # the line through the last two rows: 10 + (2 / 192) * 768
    assert past.value == pytest.approx(18.0) and (past.how, past.rows) == (EXTRAPOLATED, (64, 256))
    assert "extrapolated (N=64, N=256)" == past.describe()
    assert take([(8, 5.0), (64, 3.0)], 512).value == 3.0  # a falling trend is not taken further down
    assert take([(8, 2.0)], 64).value == pytest.approx(16.0)  # one row: in proportion to N
    with pytest.raises(ValueError, match="no measured rows"):
        take([], 8)


def test_a_scale_report_becomes_per_n_costs():
    costs = scale_costs(_report())
    assert costs.cpu_points == ((8, 0.04), (64, 0.2), (256, 0.6))
    assert costs.plan_points == ((8, 0.2), (64, 0.4))  # the row without a failure has no plan
    assert costs.latency_points == ((64, 0.03), (256, 0.09))  # nor a NaN a latency
    # the longest history's plan (the supervisor's own) beyond the rows' plan at its N
    assert (costs.history_versions, costs.history_s) == (100_000, pytest.approx(1.0))
    at = costs.at(1024)
    assert at.plan_s == pytest.approx(0.4 + 0.2 / 56 * 960 + 1.0) and at.plan.how == EXTRAPOLATED
    assert at.control_cpu_s == pytest.approx(0.6 + 0.4 / 192 * 768)
    assert at.unfit_s(1.0) == pytest.approx(at.control_cpu_s - 1.0)
    assert costs.at(64).unfit_s(1.0) == 0.0
    with pytest.raises(ValueError, match="control_cpu_ms_per_step"):
        scale_costs({"rows": []})
    with pytest.raises(ValueError, match="plan_s"):
        scale_costs({"rows": [{"n_ranks": 8, "control_cpu_ms_per_step": 1.0, "plan_s": None}]})


def test_the_grid_charges_layercheck_its_control_plane_at_each_gpu_count_and_nothing_else():
    resume = Costs(name="lc", recovery="resume", base_step_s=0.5, step_s=0.5, recovery_s=2.0, restart_s=10.0)
    rollback = Costs(
        name="full",
        recovery="rollback",
        base_step_s=0.5,
        step_s=0.6,
        interval=100,
        stall_per_event_s=5.0,
        restart_s=10.0,
    )
    scale = scale_costs(_report())
    args = dict(mtbf_hours=(2.0,), gpu_counts=(8, 1024), runs=5)
    plain = ettr.grid([resume, rollback], **args)
    charged = ettr.grid([resume, rollback], **args, scale=scale)
    assert "scale" not in plain  # without --scale the grid is as it was
    assert charged["by_mtbf"] == plain["by_mtbf"] and charged["by_gpus"]["full"] == plain["by_gpus"]["full"]
    for point in charged["by_gpus"]["lc"]:
        at = scale.at(point["gpus"])
        expected = replace(resume, recovery_s=2.0 + at.plan_s, step_s=0.5 + at.unfit_s(0.5))
        mtbf_s = ettr.PER_GPU_MTBF_HOURS / point["gpus"] * ettr.HOUR
        assert point["closed"]["ettr"] == pytest.approx(ettr.resume_ettr(expected, mtbf_s))
    assert [p["n_ranks"] for p in charged["scale"]["by_gpus"]] == [8, 1024]
    assert charged["by_gpus"]["lc"][1]["closed"]["ettr"] < plain["by_gpus"]["lc"][1]["closed"]["ettr"]


def test_layercheck_ettr_with_a_scale_report_prints_what_it_took(tmp_path, capsys):
    from layercheck.orchestrator.cli.main import main

    scale = tmp_path / "scale.json"
    scale.write_text(json.dumps(_report()))
    args = [
        "ettr",
        str(BENCH),
        "--strategies",
        "staggered,full",
        "--runs",
        "5",
        "--mtbf-hours",
        "2",
        "--gpus",
        "8,1024",
    ]
    assert main([*args, "--scale", str(scale)]) == 0
    out = capsys.readouterr().out
    assert f"from {scale}" in out and "1,024" in out
    assert "plan extrapolated (N=8, N=64), CPU extrapolated (N=64, N=256)" in out  # (no plan at 256)
    assert main([*args, "--scale", str(scale), "--json"]) == 0
    captured = capsys.readouterr()
    grid = json.loads(captured.out)  # the JSON alone on stdout, what was taken on stderr
    assert "extrapolated" in captured.err and grid["scale"]["by_gpus"][1]["n_ranks"] == 1024
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(SystemExit, match="control_cpu_ms_per_step"):
        main([*args, "--scale", str(tmp_path / "empty.json")])
