"""A multi-node run refuses node-local storage unless the user says the path is shared."""

import pytest

from layercheck.orchestrator.core.run_config import ClusterConfig
from layercheck.orchestrator.core.shared_storage import shared_storage_problem, storage_scheme


@pytest.mark.parametrize("uri", ["/data/runs/x", "runs/x", "file:///data/runs/x"])
def test_a_local_path_on_a_cluster_is_refused_naming_the_fix(uri):
    problem = shared_storage_problem(uri, alive_nodes=2, shared_storage=False)
    assert uri in problem and "2 nodes" in problem
    assert "s3://" in problem and "gs://" in problem  # the fix
    assert "cluster.shared_storage = true" in problem  # the opt-in


@pytest.mark.parametrize("uri", ["s3://b/runs/x", "gs://b/runs/x", "abfs://c@a/x", "hdfs://nn/x", "S3://b/x"])
def test_object_storage_is_shared(uri):
    assert shared_storage_problem(uri, alive_nodes=8, shared_storage=False) == ""


def test_one_node_or_the_opt_in_accepts_a_path():
    assert shared_storage_problem("/data/x", alive_nodes=1, shared_storage=False) == ""
    assert shared_storage_problem("/nfs/x", alive_nodes=3, shared_storage=True) == ""


def test_the_opt_in_is_named_as_the_caller_writes_it():
    problem = shared_storage_problem(
        "/x", alive_nodes=2, shared_storage=False, opt_in="CheckpointConfig(shared_storage=True)"
    )
    assert "CheckpointConfig(shared_storage=True)" in problem


def test_scheme():
    assert (storage_scheme("/a"), storage_scheme("file:///a"), storage_scheme("s3://b/a")) == ("", "file", "s3")


def test_the_opt_in_is_a_typed_field_off_by_default():
    assert ClusterConfig().shared_storage is False
    assert ClusterConfig(shared_storage=True).shared_storage is True
