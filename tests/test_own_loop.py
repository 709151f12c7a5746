"""examples/own_loop.py end to end through a real local Ray, as a user runs it: their own Ray
Train loop (own model, data, answer-only loss, DeepSpeed config) with LayerCheck attached, one
worker SIGKILLed; recovery at t_fail + 1 continues the failure-free losses exactly when every
layer is persisted every step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS = 10


def run_example(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu")
    proc = subprocess.run(
        [
            sys.executable,
            "examples/own_loop.py",
            "--steps",
            str(STEPS),
            "--storage",
            str(tmp_path / name),
            "--result-json",
            str(out),
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_own_loop_recovers_at_t_fail_plus_one_on_the_failure_free_trajectory(tmp_path):
    clean = run_example(tmp_path, "clean", "--policy", "every-step", "--kill-at-step", "0")
    failed = run_example(tmp_path, "failed", "--policy", "every-step", "--kill-at-step", "6")
    summary = failed["summary"]
    assert summary["failures"] == 1 and summary["state"] == "finished"
    (recovery,) = summary["recoveries"]
    assert recovery["t_fail"] == 6 and recovery["resumed_at"] == 7 and recovery["steps_redone"] == 0
    assert recovery["max_staleness"] == 0
    losses = {int(k): v for k, v in failed["losses"].items()}
    clean_losses = {int(k): v for k, v in clean["losses"].items()}
    assert sorted(losses) == list(range(1, STEPS + 1))  # no step skipped or repeated
    assert losses[STEPS] < losses[1]  # it learns
    for step, loss in losses.items():
        assert loss == pytest.approx(clean_losses[step], rel=1e-5, abs=1e-6), step
