"""`ray job submit --working-dir . -- python examples/own_loop.py` against a local `ray start
--head`, exactly as a user of the Python API does it (scripts/check_own_loop_job_submit.sh).
Uses `ray start`: run it alone."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.store.layer_store import LayerStore

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_ray_job_submit_runs_the_own_loop_example_with_a_recovery(tmp_path):
    env = {**os.environ, "VENV": str(Path(sys.executable).parent.parent)}
    proc = subprocess.run(
        [str(ROOT / "scripts/check_own_loop_job_submit.sh"), str(tmp_path / "run")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "succeeded" in proc.stdout + proc.stderr
    assert "recovery after step 6" in proc.stdout
    assert LayerStore.open(str(tmp_path / "run")).versions()
