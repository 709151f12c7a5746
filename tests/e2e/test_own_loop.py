"""examples/own_loop.py end to end through a real local Ray, as a user runs it: their own Ray
Train loop (own model, data, answer-only loss, DeepSpeed config) with LayerCheck attached, one
worker SIGKILLed and the run recovering in place (``--in-place``: the survivor runs the loop again
in its own process); recovery at t_fail + 1 continues the failure-free losses exactly when every
layer is persisted every step. (A full restart of an attached loop: tests/e2e/test_hf_trainer_sft.py.)"""

from __future__ import annotations

import pytest

from layercheck.workers.drift.hooks import FUSED_IN_PLACE
from tests.support.example_runs import assert_exact_recovery, run_examples

STEPS = 10
KILL_AT = 6


@pytest.mark.slow
def test_own_loop_recovers_at_t_fail_plus_one_on_the_failure_free_trajectory(tmp_path):
    args = ("--steps", str(STEPS), "--policy", "every-step")
    runs = {"clean": (*args, "--kill-at-step", "0"), "failed": (*args, "--kill-at-step", str(KILL_AT), "--in-place")}
    clean, failed = run_examples("own_loop.py", tmp_path, runs).values()
    assert_exact_recovery(clean, failed, steps=STEPS, kill_at=KILL_AT)
    (recovery,) = failed["summary"]["recoveries"]
    assert recovery["path"] == "in place" and recovery["kept_processes"] == 1, recovery
    assert recovery["timeline"]["group"] > 0, recovery
    probe = failed["summary"]["drift_probe"]  # the fused step in place of the user's torch AdamW, every step
    assert probe["probe"] == FUSED_IN_PLACE and probe["measured_steps"] == probe["steps"] >= STEPS, probe
    assert probe["seconds"] > 0, probe
