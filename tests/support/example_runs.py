"""Run one of examples/ as a user does (a subprocess, its own local Ray) and check a recovery
against the failure-free run. Shared by the examples' end-to-end tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_example(script: str, tmp_path: Path, name: str, *args: str) -> dict:
    """``python examples/<script> --storage TMP/name --result-json …  *args``; its result JSON."""
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p), DS_ACCELERATOR="cpu"
    )
    proc = subprocess.run(
        [sys.executable, f"examples/{script}", "--storage", str(tmp_path / name), "--result-json", str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def assert_exact_recovery(clean: dict, failed: dict, *, steps: int, kill_at: int) -> None:
    """One failure after ``kill_at``, resumed at ``kill_at + 1`` with nothing redone and nothing
    stale, every step trained once, and the losses the failure-free run's."""
    summary = failed["summary"]
    assert summary["failures"] == 1 and summary["state"] == "finished"
    (recovery,) = summary["recoveries"]
    assert recovery["t_fail"] == kill_at and recovery["resumed_at"] == kill_at + 1
    assert recovery["steps_redone"] == 0 and recovery["max_staleness"] == 0
    losses = {int(k): v for k, v in failed["losses"].items()}
    clean_losses = {int(k): v for k, v in clean["losses"].items()}
    assert sorted(losses) == list(range(1, steps + 1))  # no step skipped or repeated
    assert min(losses[s] for s in range(steps - 2, steps + 1)) < losses[1]  # it learns
    for step, loss in losses.items():
        assert loss == pytest.approx(clean_losses[step], rel=1e-5, abs=1e-6), step
