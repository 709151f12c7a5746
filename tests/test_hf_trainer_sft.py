"""examples/hf_trainer_sft.py end to end through a real local Ray, as a user runs it: TRL's
SFTTrainer with DeepSpeed (ZeRO-2 with DeepSpeed's schedule; ZeRO-3 with the Trainer's own) on
2 Ray Train workers, LayerCheck added by its callback, one
worker SIGKILLed. The restart resumes at t_fail + 1 in the next epoch (48 pairs, 6 steps an
epoch: the Trainer's step, learning-rate schedule and shuffled data order all moved), and with
every layer persisted at t_fail the losses after recovery are the failure-free run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS = 12
KILL_AT = 8  # step 9 is epoch 1's third step
WRITES = ("--no-fsync",)  # every-step mode lets a layer's versions queue up: each step's is written


def run_example(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p), DS_ACCELERATOR="cpu"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "examples/hf_trainer_sft.py",
            "--steps",
            str(STEPS),
            "--rows",
            "48",
            "--policy",
            "every-step",
            *WRITES,
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
@pytest.mark.parametrize(
    "setup",
    [("--zero-stage", "2", "--schedule", "deepspeed"), ("--zero-stage", "3", "--schedule", "trainer")],
    ids=["zero2-deepspeed-schedule", "zero3-trainer-schedule"],
)
def test_sft_trainer_recovers_at_t_fail_plus_one_on_the_failure_free_trajectory(tmp_path, setup):
    pytest.importorskip("trl", reason="TRL is a test dependency (pip install -e '.[test]')")
    clean = run_example(tmp_path, "clean", *setup, "--kill-at-step", "0")
    failed = run_example(tmp_path, "failed", *setup, "--kill-at-step", str(KILL_AT))
    summary = failed["summary"]
    assert summary["failures"] == 1 and summary["state"] == "finished"
    (recovery,) = summary["recoveries"]
    assert recovery["t_fail"] == KILL_AT and recovery["resumed_at"] == KILL_AT + 1
    assert recovery["steps_redone"] == 0 and recovery["max_staleness"] == 0
    losses = {int(k): v for k, v in failed["losses"].items()}
    clean_losses = {int(k): v for k, v in clean["losses"].items()}
    assert sorted(losses) == list(range(1, STEPS + 1))  # no step skipped or repeated
    assert min(losses[s] for s in range(STEPS - 2, STEPS + 1)) < losses[1]  # it learns
    for step, loss in losses.items():
        assert loss == pytest.approx(clean_losses[step], rel=1e-5, abs=1e-6), step
