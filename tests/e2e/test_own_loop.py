"""examples/own_loop.py end to end through a real local Ray, as a user runs it: their own Ray
Train loop (own model, data, answer-only loss, DeepSpeed config) with LayerCheck attached, one
worker SIGKILLed and the run recovering in place with a warm spare (``--in-place --spares 1``: the
survivor runs the loop again in its own process, and a third worker, which ran the loop up to its
``deepspeed.initialize`` and waited there, goes on as the lost rank); recovery at t_fail + 1
continues the failure-free losses exactly when every layer is persisted every step, which also
says that the spare trained on the lost rank's data (its rank and world size from Ray Train's
context). (A full restart of an attached loop: tests/e2e/test_hf_trainer_sft.py; in place without
a spare: its ZeRO-3 run.)"""

from __future__ import annotations

import pytest

from layercheck.workers.drift.hooks import FUSED_IN_PLACE
from tests.support.example_runs import assert_exact_recovery, run_examples

STEPS = 10
KILL_AT = 6


@pytest.mark.slow
def test_own_loop_recovers_in_place_with_a_warm_spare_at_t_fail_plus_one_on_the_failure_free_trajectory(tmp_path):
    args = ("--steps", str(STEPS), "--policy", "every-step")
    spare = ("--in-place", "--spares", "1")
    runs = {"clean": (*args, "--kill-at-step", "0"), "failed": (*args, "--kill-at-step", str(KILL_AT), *spare)}
    clean, failed = run_examples("own_loop.py", tmp_path, runs).values()
    assert_exact_recovery(clean, failed, steps=STEPS, kill_at=KILL_AT)
    (recovery,) = failed["summary"]["recoveries"]
    assert recovery["path"] == "in place" and recovery["kept_processes"] == 1, recovery
    assert recovery["spares_promoted"] == 1 and recovery["timeline"]["group"] > 0, recovery
    # each rank's own phases: the survivor's rerun of the loop, and the spare's since its promotion
    by_kind = {("spare" if r["spare"] else "survivor" if r["kept_process"] else "cold"): r for r in recovery["ranks"]}
    assert set(by_kind) == {"survivor", "spare"} and by_kind["spare"]["start_s"] == 0.0, recovery["ranks"]
    assert by_kind["survivor"]["build_s"] > 0 and by_kind["spare"]["build_s"] > 0, recovery["ranks"]
    spares = failed["summary"]["spares"]  # what the spare cost: a worker held idle beside the two training
    assert spares["spares"] == 1 and spares["promotions"] == 1 and spares["training_workers"] == 2, spares
    probe = failed["summary"]["drift_probe"]  # the fused step in place of the user's torch AdamW, every step
    assert probe["probe"] == FUSED_IN_PLACE and probe["measured_steps"] == probe["steps"] >= STEPS, probe
    assert probe["seconds"] > 0, probe
