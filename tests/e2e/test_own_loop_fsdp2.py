"""examples/own_loop_fsdp2.py end to end through a real local Ray, as a user runs it: their own Ray
Train loop with the model sharded by PyTorch FSDP2 (``fully_shard`` on gloo), torch's AdamW and a
``LambdaLR``, LayerCheck attached with ``attach(model, optimizer, lr_scheduler=...)``. One worker is
SIGKILLed under the default staggered schedule and the run recovers in place: the survivor keeps its
process, a warm spare (``--spares 1``: it built its model and waited for its rank) goes on as the
lost rank, and with memory versions every step (``persistence.memory_period = 1``) the lost rank's
slices come back from the writers' memory, so the recovery at t_fail + 1 continues the failure-free
losses exactly, though no layer was stored at t_fail. (Under ``ray job submit``, with the API's
default schedule and an export: tests/e2e/test_job_submit.py.)"""

from __future__ import annotations

import pytest

from tests.support.example_runs import assert_exact_recovery, run_examples

STEPS = 10
KILL_AT = 6


@pytest.mark.slow
def test_an_fsdp2_loop_recovers_in_place_at_t_fail_plus_one_on_the_failure_free_trajectory(tmp_path):
    runs = {
        "clean": ("--steps", str(STEPS), "--kill-at-step", "0"),
        "failed": (
            "--steps",
            str(STEPS),
            "--kill-at-step",
            str(KILL_AT),
            "--in-place",
            "--spares",
            "1",
            "--memory-period",
            "1",
        ),
    }
    clean, failed = run_examples("own_loop_fsdp2.py", tmp_path, runs).values()
    assert failed["summary"]["engine"] == clean["summary"]["engine"] == "fsdp2"
    assert_exact_recovery(clean, failed, steps=STEPS, kill_at=KILL_AT)
    (recovery,) = failed["summary"]["recoveries"]
    assert recovery["path"] == "in place" and recovery["kept_processes"] == 1, recovery
    # a warm spare, which had built its model and waited for its rank, went on as the lost rank
    assert recovery["spares_promoted"] == 1 and recovery["timeline"]["start"] == 0.0, recovery
    # the staggered schedule stored no layer at step 6 on its own: the writers' memory made it exact
    origins = {(s["origin"], s["step"]) for sources in recovery["sources"].values() for s in sources}
    assert ("memory", KILL_AT) in origins, recovery["sources"]
    checks = failed["summary"]["memory_period_checks"]
    assert checks and all(check["kept"] for check in checks), checks
