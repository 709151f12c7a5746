"""``persistence.memory_period = "auto"`` under the local runtime: rank 0's supervisor chooses the
period from its progress, the choice rides on rank 0's exchanged report, and every rank's policy
replica puts it on its decisions from the same step on (``orchestrator/local/exchange.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from layercheck.orchestrator.local.local_coordinator import LocalCoordinator
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.policies.checkpoint_policy import build_policy
from layercheck.policies.configs import StaggeredConfig, drift_measured
from layercheck.workers.drift.probe import LayerDrift
from layercheck.workers.progress import StepProgress
from tests.support.dist_harness import run_ranks

NUMEL = {"embed": 4000, "block.0": 1000, "lm_head": 3000}
EVERY = 4  # drift measured at steps 1, 5, 9, 13
STEPS = 13


def _auto_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """One rank's coordinator fed as the loop feeds it; rank 0 reports copies of 30 ms in steps of
    100 ms (from step 2, where the first memory version is taken)."""
    dist.init_process_group("gloo")  # (spawn_ranks set the rendezvous; it destroys the group after)
    coordinator = LocalCoordinator(
        policy=build_policy(StaggeredConfig(period=4, drift_every=EVERY), NUMEL),
        layer_numel=NUMEL,
        store=LayerStore.open(root, fsync=False),
        max_inflight_bytes=2**20,
        drift_every=EVERY,
        memory_bytes=2**30,
        memory_period="auto",
    )
    start, carried, handle = coordinator.memory_period, {}, None
    for step in range(1, STEPS + 1):
        measured = drift_measured(step, EVERY)
        drift = LayerDrift(step=step, l1=dict.fromkeys(NUMEL, 1e-3) if measured else {}, numel=NUMEL, measured=measured)
        new = coordinator.report(drift, 1e-3)
        if handle is not None:  # the loop collects step t's decision after step t + 1
            decision = coordinator.decision(handle)
            carried[handle] = decision.memory_period if decision is not None else None
        handle = new
        if rank == 0:
            memory_s = 0.03 if step > 1 else 0.0
            coordinator.progress(
                StepProgress(step=step, loss=1.0, lr=1e-3, compute_s=0.1, stall_s=memory_s, memory_s=memory_s)
            )
    status = coordinator.status()
    closed = coordinator.close(60)
    return {"start": start, "carried": carried, "status": status["memory_period"] if status else None, "closed": closed}


@pytest.mark.slow  # two spawned ranks: ~10 s on a 2-core machine
def test_every_rank_takes_the_period_rank_0s_supervisor_chose_from_the_same_step(tmp_path):
    outs = run_ranks(_auto_job, 2, str(tmp_path))
    assert all(out["closed"] and out["start"] == 0 for out in outs)  # "auto": nothing before a decision says
    assert outs[0]["carried"] == outs[1]["carried"]  # the same decisions on every rank
    carried = {int(step): period for step, period in outs[0]["carried"].items()}
    # every step until chosen (copies 3-5 timed, the first at step 2 allocates); 30% of a step: every 30;
    # the choice rides on rank 0's next exchanged report (step 9) and its decisions on
    following, periods = 0, {}
    for step in sorted(carried):
        following = carried[step] if carried[step] is not None else following  # (None: no news, kept)
        periods[step] = following
    assert [periods[s] for s in range(1, 9)] == [1] * 8 and [periods[s] for s in range(9, STEPS)] == [30] * 4
    assert carried[1] == carried[5] == 1 and carried[9] == 30  # the measured steps' decisions carry it
    status = outs[0]["status"]
    assert (status["period"], status["chosen_at"]) == (30, 5) and status["why"].startswith("auto: 30 (copy 30.0 ms")
