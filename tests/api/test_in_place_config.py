"""What in-place recovery asks of a user's own run (``CheckpointConfig(in_place=True)``), checked
before anything starts, and the id each run of their loop joins the supervisor with."""

import pytest
from ray.train import ScalingConfig

from layercheck import CheckpointConfig
from layercheck.orchestrator.runtime.context import Incarnation
from layercheck.policies.config_loader import ConfigError
from layercheck.trainer import check_in_place


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
