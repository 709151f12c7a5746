"""The TorchTrainer LayerCheck runs (orchestrator/runtime/ray_trainer.py): Ray Train's callbacks,
less Ray Data's when the run passes no datasets (its DatasetManager actor would start at every
worker-group start for nothing); a trainer given datasets keeps it."""

from __future__ import annotations

from ray.train import ScalingConfig
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

from layercheck.orchestrator.runtime.in_place import InPlaceTorchTrainer
from layercheck.orchestrator.runtime.ray_trainer import LayerCheckTorchTrainer


def _loop() -> None:
    pass


def _kinds(trainer) -> set[type]:
    return {type(callback) for callback in trainer._create_default_callbacks()}


def test_a_run_without_datasets_starts_no_dataset_manager_and_one_with_them_does():
    scaling = ScalingConfig(num_workers=2)
    for trainer_class in (LayerCheckTorchTrainer, InPlaceTorchTrainer):
        kinds = _kinds(trainer_class(_loop, scaling_config=scaling))
        assert DatasetsCallback not in kinds, trainer_class
        assert len(kinds) > 1, "Ray Train's other callbacks stay"
    with_data = LayerCheckTorchTrainer(_loop, scaling_config=scaling, datasets={"train": [1, 2, 3]})
    assert DatasetsCallback in _kinds(with_data)


def test_without_a_state_api_the_placement_group_cleaner_is_left_out(monkeypatch):
    """The cleaner polls Ray's State API, which the dashboard serves: on the local Ray LayerCheck
    starts without one it could never tell whether the controller lives (and logged so every
    second); that Ray ends with the driver, placement groups and all. A cluster joined keeps it."""
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    from layercheck.orchestrator.runtime import cluster

    scaling = ScalingConfig(num_workers=2)
    monkeypatch.setitem(cluster._LOCAL_RAY, "without_dashboard", True)
    assert not cluster.has_state_api()
    for trainer_class in (LayerCheckTorchTrainer, InPlaceTorchTrainer):
        assert PlacementGroupCleanerCallback not in _kinds(trainer_class(_loop, scaling_config=scaling))
    monkeypatch.setitem(cluster._LOCAL_RAY, "without_dashboard", False)
    assert PlacementGroupCleanerCallback in _kinds(LayerCheckTorchTrainer(_loop, scaling_config=scaling))
