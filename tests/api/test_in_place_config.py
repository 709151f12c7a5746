"""What in-place recovery asks of a user's own run (``CheckpointConfig(in_place=True)``), checked
before anything starts, and the id each run of their loop joins the supervisor with."""

import pytest
from ray.train import ScalingConfig

from layercheck import CheckpointConfig
from layercheck.orchestrator.runtime.context import Incarnation
from layercheck.policies.config_loader import ConfigError
from layercheck.trainer import check_in_place, spares_figures, with_spares


def test_in_place_needs_a_fixed_group_and_its_own_torch_config():
    check_in_place(ScalingConfig(num_workers=2), None)
    with pytest.raises(ConfigError, match="fixed group"):
        check_in_place(ScalingConfig(num_workers=(1, 2)), None)
    with pytest.raises(ConfigError, match="leave LayerCheckTrainer\\(torch_config=...\\) unset"):
        check_in_place(ScalingConfig(num_workers=2), object())
    with pytest.raises(ConfigError, match="regroup_timeout_s"):
        CheckpointConfig(storage="/tmp/x", in_place=True, regroup_timeout_s=0)


def test_each_run_of_the_loop_in_one_process_joins_as_a_new_worker():
    assert Incarnation().worker_id("actor") == "actor"
    assert Incarnation(number=2).worker_id("actor") == "actor/2"


def test_spares_need_in_place_and_ray_train_runs_them_beside_the_training_workers():
    with pytest.raises(ConfigError, match="spares: .*0 unless in_place=True"):
        CheckpointConfig(storage="/tmp/x", spares=1)
    with pytest.raises(ConfigError, match="spares"):
        CheckpointConfig(storage="/tmp/x", in_place=True, spares=-1)
    scaling = ScalingConfig(num_workers=2, use_gpu=False)
    assert with_spares(scaling, 1).num_workers == 3 and with_spares(scaling, 0) is scaling
    # what the summary says of them, as for the built-in loop: the idle workers' cost
    figures = spares_figures({"spares": 1, "waiting": 1, "promotions": 1}, scaling)
    assert figures == {
        "spares": 1,
        "waiting": 1,
        "promotions": 1,
        "training_workers": 2,
        "cpus_per_worker": 1.0,
        "gpus_per_worker": 0,
    }
