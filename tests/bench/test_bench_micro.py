"""The micro-benchmarks (`layercheck.bench.drift_probe` and the probes `bench/probes/snapshot_stall.py`,
`default_step.py`, `fused_issue.py`, `ray_answer.py`, `sender_gil.py`) run end to end on CPU and report every figure they
promise; the timing helpers they share count what they say."""

from __future__ import annotations

import json

import pytest

from layercheck.bench import drift_probe, timing
from tests.support.checkout import probe

default_step, fused_issue, ray_answer, sender_gil, snapshot_stall = map(
    probe, ("default_step", "fused_issue", "ray_answer", "sender_gil", "snapshot_stall")
)


def test_time_interleaved_runs_each_function_in_turn_and_drops_the_warm_up():
    calls: list[str] = []
    seconds = timing.time_interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, "cpu", steps=3, warmup=2
    )
    assert calls == ["a", "b"] * 5  # in turn, warm-up included
    assert set(seconds) == {"a", "b"} and all(s >= 0 for s in seconds.values())
    assert timing.issue_seconds(lambda: None, "cpu", steps=2) >= 0


@pytest.mark.slow
def test_drift_probe_times_every_variant_and_the_training_step(tmp_path, capsys):
    out = tmp_path / "probe.json"
    drift_probe.main(["--steps", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["preset"] == "cpu-small" and result["device"] == "cpu" and result["params"] > 0
    assert {"drift_adamw", "drift_fused", "snapshot_diff", "l1_params"} <= set(result["probes"])
    assert {"adamw/new_grads", "drift_fused/new_grads"} <= set(result["probes"]) and result[
        "fused_x_adamw_new_grads"
    ] > 0
    for row in result["probes"].values():
        assert row["seconds"] > 0 and row["x_adamw"] > 0
    assert result["optimizer_step_s"] > 0 and result["training_step_s"] > 0 and result["training_step_fused_s"] > 0
    assert result["kernel_sweep"] == []  # the sweep is CUDA-only
    assert "drift_fused" in capsys.readouterr().out  # the table


@pytest.mark.slow
def test_default_step_times_the_built_in_loops_step_against_torchs_fused_adamw(tmp_path, capsys):
    out = tmp_path / "default.json"
    default_step.main(["--steps", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["choice"]["measured"] == "foreach"
    assert result["choice"]["torch_step"] == "fused" and "cpu-drift-sampling" in result["choice"]["reason"]
    assert set(result["optimizer_s"]) == {"adamw_fused", "default@10", "default@1"}
    assert set(result["training_step_s"]) == {"default@10", "unmeasured"}
    assert all(s > 0 for s in [*result["optimizer_s"].values(), *result["training_step_s"].values()])
    assert result["goal"] == 0.01 and isinstance(result["goal_met"], bool)
    assert "of the training step" in capsys.readouterr().out


@pytest.mark.slow
def test_snapshot_stall_measures_the_largest_layer_and_blocks(tmp_path, capsys):
    out = tmp_path / "stall.json"
    snapshot_stall.main(["--steps", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["zero_stage"] == 3
    layers = {row["layer"]: row for row in result["layers"]}
    assert "embed" in layers and any(name.startswith("block.") for name in layers)
    for row in layers.values():
        assert row["bytes"] > 0 and row["copy_s"] > 0 and row["step_s"] > 0
        assert row["stall_side_s"] >= 0 and row["stall_host_s"] >= 0 and row["issue_side_s"] > 0
    assert result["profile"] is None  # --profile is for CUDA
    assert "side stall" in capsys.readouterr().out


def _waits_on_a_scalar(x):
    return (x @ x).sum().item()


def test_a_profile_names_the_calls_that_blocked_and_who_called_them():
    import torch
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        _waits_on_a_scalar(x)
    found = snapshot_stall.blocking_calls(prof, min_ms=0.0)
    items = [call for call in found["blocking"] if call["name"] == "aten::item"]
    assert items and any("_waits_on_a_scalar" in frame for frame in items[0]["stack"])
    assert found["dtoh_copies"] == 0 and found["longest_dtoh"] == []  # no device here


def test_fused_issue_times_the_steps_bookkeeping_and_puts_everything_back():
    import importlib.util
    import sys

    from layercheck.workers.drift import fused as drift_fused

    eligible = drift_fused.triton_eligible
    result = fused_issue.run(steps=5)
    assert result["tensors"] == 290 and result["groups"] == 50 and result["steps"] == 5
    assert 0 < result["host_s"] <= result["host_s_p90"]
    assert 0 < result["host_new_grads_s"] <= result["host_new_grads_s_p90"]
    assert drift_fused.triton_eligible is eligible
    if importlib.util.find_spec("triton") is None:
        assert "triton" not in sys.modules and "layercheck.workers.drift.triton_step" not in sys.modules


def test_ray_answer_times_both_ways_of_collecting_the_policys_answer(local_ray, capsys):
    result = ray_answer.run(steps=10, step_s=0.01)  # each collection checks it got its own step's answer
    assert result["steps"] == 10
    for way in ray_answer.WAYS:
        assert 0 < result[f"{way}_s"] <= result[f"{way}_s_p90"]
    assert result["future_vs_wait_get"] == result["future_s"] / result["wait_get_s"]
    ray_answer.main(["--steps", "10", "--step-s", "0.01"])
    assert "future / wait+get" in capsys.readouterr().out


def test_sender_gil_times_the_step_beside_every_kind_of_sending_thread(local_ray, capsys):
    result = sender_gil.run(rounds=6, ops=100, busy_ms=0.2)
    assert result["none_excess_s"] == 0
    for mode in sender_gil.MODES:
        assert result[f"{mode}_s"] > 0
        assert result[f"{mode}_excess_s"] == result[f"{mode}_s"] - result["none_s"]
    sender_gil.main(["--rounds", "4", "--ops", "50", "--busy-ms", "0.1"])
    assert "report+progress" in capsys.readouterr().out
