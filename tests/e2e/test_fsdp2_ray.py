"""The built-in loop on PyTorch FSDP2 (``[engine] backend = "fsdp2"``: ``fully_shard`` on gloo) on a
real local Ray, and one store for both engines at any world size: the failure-free DeepSpeed ZeRO-3
run of 2 ranks (the ``clean_run`` fixture) is resumed by FSDP2 on 3 ranks, which loses a rank and
recovers in place, a warm spare taking the lost rank, and that store is resumed again by DeepSpeed
ZeRO-1 on 1 rank. Every resume and recovery starts at the step after the last one trained, with the
trained weights."""

import shutil

import pytest

from layercheck.orchestrator.runtime.run_summary import format_summary, summarize
from layercheck.orchestrator.store.layer_store import LayerStore
from tests.support.ray_runs import EVERY_STEP, UNBOUNDED, train_demo

pytestmark = pytest.mark.slow


def _history(result) -> dict[int, float]:
    return {int(k): v[0] for k, v in result.status["account"]["history"].items()}


def test_one_store_is_resumed_across_engines_and_world_sizes_and_fsdp2_recovers_in_place_with_a_spare(
    local_ray, clean_run, tmp_path
):
    shutil.copytree(clean_run.config.storage_uri, tmp_path / "cross")
    trained = _history(clean_run)  # DeepSpeed ZeRO-3, 2 ranks, steps 1-12
    # 2 DeepSpeed ranks -> 3 FSDP2 ranks (uneven shards), rank 1 SIGKILLed after step 14, in place,
    # a warm spare (its model built, waiting) promoted to rank 1
    fsdp2 = train_demo(
        tmp_path,
        "cross",
        policy=EVERY_STEP,
        resume=True,
        **{
            "engine.backend": "fsdp2",
            "cluster.num_workers": 3,
            "cluster.cpus_per_worker": 0.5,
            "cluster.in_place": True,
            "cluster.spares": 1,
            "steps": 16,
            "log_every": 4,
            "fault.kill_at_step": 14,
            **UNBOUNDED,
        },
    )
    assert fsdp2.status["state"] == "finished" and fsdp2.status["account"]["engine"] == "fsdp2"
    resumed, failed = fsdp2.status["account"]["recoveries"]
    assert resumed["kind"] == "resume" and (resumed["t_fail"], resumed["resumed_at"]) == (12, 13), resumed
    assert resumed["max_staleness"] == 0 and resumed["world_size"] == 3, resumed
    assert (failed["t_fail"], failed["resumed_at"], failed["steps_redone"]) == (14, 15, 0), failed
    assert failed["path"] == "in place" and failed["kept_processes"] == 2, failed
    assert failed["spares_promoted"] == 1 and failed["timeline"]["start"] == 0.0, failed
    history = _history(fsdp2)
    assert sorted(history) == [13, 14, 15, 16]
    # the trained weights came back (a fresh model would be back near the step-1 loss)
    assert history[13] < trained[1] - 0.3 and abs(history[13] - trained[12]) < 0.3
    text = format_summary(summarize(fsdp2))
    assert "PyTorch FSDP2 (fully_shard)" in text
    # every version FSDP2 stored is layers and element ranges over 3 ranks, as DeepSpeed's are over 2
    versions = LayerStore.open(fsdp2.config.storage_uri).versions()
    assert {v.world_size for v in versions if v.step == 16 and not v.partial} == {3}

    # 3 FSDP2 ranks -> 1 DeepSpeed ZeRO-1 rank
    ds = train_demo(
        tmp_path,
        "cross",
        policy=EVERY_STEP,
        resume=True,
        **{"engine.zero_stage": 1, "cluster.num_workers": 1, "steps": 18, "log_every": 2, "fault.kill_at_step": 0},
    )
    assert ds.status["account"]["engine"] == "deepspeed"
    (resumed,) = ds.status["account"]["recoveries"]
    assert (resumed["t_fail"], resumed["resumed_at"], resumed["max_staleness"]) == (16, 17, 0), resumed
    continued = _history(ds)
    assert sorted(continued) == [17, 18]
    assert abs(continued[17] - history[16]) < 0.3 and continued[17] < trained[1] - 0.3
