"""How a user reaches a running Ray cluster, exactly as they do it, against one local
`ray start --head` (scripts/check_job_submit.sh): `ray job submit` of `layercheck train` and of
the own-loop FSDP2 example (examples/own_loop_fsdp2.py), each with an injected failure recovered in place, and a driver on the head joining the running
cluster with RAY_ADDRESS unset (what `layercheck train` does first). Its `ray start` keeps to a Ray
temp folder of its own and stops only its own cluster, so other tests run beside it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from layercheck.orchestrator.store.layer_store import LayerStore

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_ray_job_submit_and_a_driver_on_the_head_reach_the_running_cluster(tmp_path):
    env = {**os.environ, "VENV": str(Path(sys.executable).parent.parent)}
    proc = subprocess.run(
        [str(ROOT / "scripts/check_job_submit.sh"), str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert out.count("succeeded") >= 2  # both submitted jobs
    assert "recovery after step 8" in proc.stdout  # the demo's injected failure
    assert "in place (1 rank kept its process, 1 spare promoted)" in proc.stdout  # its warm spare took over
    # the own loop's, under the API's default schedule (a layer every 100 steps): resumed at t_fail + 1
    # from the step-0 versions attach handed over (no layer was saved by the policy before the kill)
    # (without them the run would restart from the initial weights: "resumed at 1")
    assert "recovery after step 6" in proc.stdout and "resumed at 7" in proc.stdout
    own_loop = proc.stdout[proc.stdout.index("== 2.") :]
    assert "in place (1 rank kept its process)" in own_loop
    assert "PyTorch FSDP2 (fully_shard)" in own_loop  # the engine the ranks reported
    # ... and it exports with no extra file (model.json)
    import transformers

    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "own-loop-hf"))
    assert exported.config.num_hidden_layers == 2
    for run in ("demo", "own-loop"):
        assert LayerStore.open(str(tmp_path / run)).versions(), run
    # the third driver joined the running cluster (`ray start --num-cpus=4`) instead of starting its own
    third = out[out.index("== 3.") :]
    assert "joined the Ray cluster at" in third and "started a local Ray" not in third
    assert "with 4 CPUs" in third
