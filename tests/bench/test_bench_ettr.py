"""The cluster-scale ETTR model: Young/Daly closed forms and the Monte-Carlo simulation."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from layercheck.bench import ettr
from layercheck.bench.ettr import Costs


def _rollback(**kw) -> Costs:
    base = dict(
        name="full",
        recovery="rollback",
        base_step_s=1.0,
        step_s=1.1,
        interval=10,
        stall_per_event_s=1.0,
        bytes_per_event=1e9,
        bytes_per_step=1e8,
        recovery_s=5.0,
        restart_s=10.0,
        sync_write=True,
    )
    return Costs(**{**base, **kw})


def test_young_interval():
    assert ettr.young_interval_s(2.0, 3600.0) == pytest.approx(math.sqrt(2 * 2 * 3600))


def test_daly_tends_to_the_overhead_only_when_failures_vanish():
    value = ettr.daly_ettr(interval_s=100.0, checkpoint_s=10.0, restart_s=0.0, mtbf_s=1e12)
    assert value == pytest.approx(100 / 110, rel=1e-6)


def test_young_interval_is_near_the_daly_optimum():
    m, delta, r = 3600.0, 20.0, 30.0
    best = ettr.young_interval_s(delta, m)
    at_best = ettr.daly_ettr(interval_s=best, checkpoint_s=delta, restart_s=r, mtbf_s=m)
    for tau in (best / 3, best * 3):
        assert ettr.daly_ettr(interval_s=tau, checkpoint_s=delta, restart_s=r, mtbf_s=m) < at_best


def test_no_failures_gives_the_step_time_ratio():
    rng = random.Random(0)
    for costs in (_rollback(), _rollback(recovery="resume"), _rollback(recovery="restart")):
        assert ettr.simulate_once(costs, 1e15, 1000, rng) == pytest.approx(1 / 1.1)


def test_simulation_agrees_with_the_closed_forms():
    m = 2000.0
    resume = _rollback(recovery="resume", step_s=1.0, recovery_s=5.0, restart_s=15.0)
    sim = ettr.simulate(resume, m, runs=300, work_s=200_000)["mean"]
    assert sim == pytest.approx(ettr.resume_ettr(resume, m), rel=0.01)
    rollback = _rollback(step_s=1.1, interval=10, stall_per_event_s=1.0)
    sim = ettr.simulate(rollback, m, runs=300, work_s=200_000)["mean"]
    assert sim == pytest.approx(ettr.closed_form(rollback, m)["ettr"], rel=0.02)


def test_rollback_loses_more_than_resume_at_the_same_costs():
    m = 600.0
    rollback = _rollback(step_s=1.0, stall_per_event_s=0.0, interval=200)
    resume = _rollback(step_s=1.0, stall_per_event_s=0.0, interval=200, recovery="resume")
    assert ettr.simulate(resume, m, runs=100)["mean"] > ettr.simulate(rollback, m, runs=100)["mean"]


def test_restart_collapses_when_the_job_outlasts_the_mtbf():
    costs = _rollback(recovery="restart", step_s=1.0)
    assert ettr.simulate(costs, 100.0, runs=10, work_s=10_000)["mean"] < 1e-10


def test_storage_bandwidth_rescales_the_sync_stall_and_throttles_async_writes():
    sync = _rollback().with_storage(1e8)  # 1 GB per checkpoint at 0.1 GB/s: 10 s
    assert sync.stall_per_event_s == pytest.approx(10.0)
    assert sync.step_s == pytest.approx(1.1 - 0.1 + 1.0)
    async_ = _rollback(sync_write=False, bytes_per_step=5e8, step_s=1.0).with_storage(1e8)
    assert async_.step_s == pytest.approx(5.0)


def test_grid_has_every_point():
    g = ettr.grid(
        [_rollback(), _rollback(name="lc", recovery="resume")], mtbf_hours=(0.5, 24), gpu_counts=(8, 16384), runs=5
    )
    assert [p["mtbf_hours"] for p in g["by_mtbf"]["lc"]] == [0.5, 24]
    assert [p["gpus"] for p in g["by_gpus"]["full"]] == [8, 16384]
    assert g["by_gpus"]["full"][1]["sim"]["mean"] < g["by_gpus"]["full"][0]["sim"]["mean"]


def test_invalid_costs():
    with pytest.raises(ValueError, match="recovery"):
        _rollback(recovery="pray")
    with pytest.raises(ValueError, match="interval"):
        _rollback(interval=0)


RECOVERY_PATHS = Path(__file__).resolve().parents[2] / "bench" / "results" / "cpu-in-place" / "recovery_paths.json"
BENCH = Path(__file__).resolve().parents[2] / "bench" / "results" / "cpu-default" / "bench.json"


def test_a_measured_recovery_path_sets_the_restart_less_the_strategys_own_plan_load_and_first_step():
    timeline = {"plan": 0.5, "load": 1.0, "first_step": 0.5, "build": 4.0}
    report = {
        "runs": {
            "full restart": [
                {"failure_to_step_s": 12.0, "timeline": timeline},
                {"failure_to_step_s": 16.0, "timeline": timeline},
            ],
            "in place": [{"failure_to_step_s": 7.0, "timeline": timeline}],
        }
    }
    assert ettr.restart_by_path(report) == {"full restart": 12.0, "in place": 5.0}
    with pytest.raises(ValueError, match="no runs"):
        ettr.restart_by_path({"runs": {"in place": []}})


def test_layercheck_ettr_compares_the_recovery_paths_measured_on_real_runs(capsys):
    """The committed bench report and recovery-path measurements, as a user runs it: each resuming
    strategy once per path with that path's measured restart (a rollback baseline has no in
    place), and in place never scores below the full restart."""
    from layercheck.orchestrator.cli.main import main

    args = ["ettr", str(BENCH), "--recovery-paths", str(RECOVERY_PATHS), "--runs", "20", "--json"]
    assert main([*args, "--strategies", "staggered,full"]) == 0
    grid = json.loads(capsys.readouterr().out)
    paths = ("full restart", "in place", "in place + spare")
    assert set(grid["by_mtbf"]) == {*(f"staggered · {p}" for p in paths), "full · full restart"}
    measured = ettr.restart_by_path(json.loads(RECOVERY_PATHS.read_text()))
    restarts = {c["name"]: c["restart_s"] for c in grid["costs"]}
    assert restarts["staggered · in place"] == measured["in place"] < restarts["staggered · full restart"]
    assert restarts["staggered · in place + spare"] == measured["in place + spare"] < measured["in place"]
    by_path = [grid["by_mtbf"][f"staggered · {p}"] for p in paths]
    for restart, in_place, spare in zip(*by_path):
        assert spare["closed"]["ettr"] > in_place["closed"]["ettr"] > restart["closed"]["ettr"]
    with pytest.raises(SystemExit, match="give one"):
        main([*args, "--restart-s", "3"])
