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


def run_examples(script: str, tmp_path: Path, runs: dict[str, tuple[str, ...]]) -> dict[str, dict]:
    """Several runs of ``examples/<script>`` at once (name → its arguments), each a subprocess with
    its own local Ray, as a user runs it; each run's result JSON. At once: a run leaves half of a
    2-core machine idle (its Ray start, imports and waits), and the runs do not depend on each other."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p), DS_ACCELERATOR="cpu"
    )
    procs = {}
    for name, args in runs.items():
        out = tmp_path / f"{name}.json"
        command = [sys.executable, f"examples/{script}", "--storage", str(tmp_path / name), "--result-json", str(out)]
        procs[name] = subprocess.Popen(
            [*command, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    results = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=900)
            assert proc.returncode == 0, f"{name}: " + stdout[-3000:] + stderr[-3000:]
            results[name] = json.loads((tmp_path / f"{name}.json").read_text())
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return results


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
