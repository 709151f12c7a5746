"""A real two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head and a
second node, one logical CPU each, so the two workers land one per node); the second node is
removed mid-run (its raylet, its worker and its writer actor die with it). The elastic group
(``cluster.min_workers = 1``) resumes at ``t_fail + 1`` on the head alone, nothing committed is
lost, and new versions are written by the head's writer. Also: the same cluster refuses a
node-local storage path unless ``cluster.shared_storage`` says it is shared."""

import threading

import pytest
import ray
from ray.cluster_utils import Cluster

from orchestrator.core.run_config import load_run_config
from orchestrator.runtime.driver import train
from orchestrator.store.errors import UnsafeStoreError
from orchestrator.store.layer_store import LayerStore

pytestmark = pytest.mark.slow

KILL_AFTER_STEP = 8
STEPS = 24


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    second = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster, second
    ray.shutdown()
    cluster.shutdown()


def _config(cluster, tmp_path, name, **overrides):
    return load_run_config(
        "examples/demo.toml",
        {
            "name": name,
            "storage": str(tmp_path / name),
            "steps": STEPS,
            "optim.total_steps": STEPS,
            "optim.warmup_steps": 2,
            "policy.warmup_steps": 2,
            "metrics.port": 0,
            "fault.kill_at_step": 0,
            "cluster.address": cluster.address,
            "cluster.num_workers": 2,
            "cluster.min_workers": 1,
            "cluster.cpus_per_worker": 1,
            **overrides,
        },
    )


def test_a_local_path_on_two_nodes_is_refused_before_anything_is_written(cluster, tmp_path):
    head, _ = cluster
    with pytest.raises(UnsafeStoreError, match="cluster.shared_storage = true"):
        train(_config(head, tmp_path, "refused"))
    assert not (tmp_path / "refused").exists()


def test_losing_a_node_resumes_on_the_rest_at_t_fail_plus_one_and_loses_nothing_committed(cluster, tmp_path):
    head, second = cluster
    config = _config(head, tmp_path, "nodeloss", **{"cluster.shared_storage": True})
    killed: dict = {}
    lock = threading.Lock()

    def kill_second_node(status):
        with lock:
            if killed or status.get("step", 0) < KILL_AFTER_STEP:
                return
            killed["committed"] = {v.version_id: v for v in LayerStore.open(config.storage_uri).versions()}
            killed["step"] = status["step"]
            head.remove_node(second, allow_graceful=False)  # raylet, worker, writer: gone at once

    result = train(config, on_progress=kill_second_node, poll_s=0.2)
    assert result.error is None, result.error
    assert killed, "the run ended before the node was removed"
    status = result.status
    assert status["state"] == "finished"
    recoveries = status["account"]["recoveries"]
    assert recoveries, "the node's loss was not recovered from"
    first = recoveries[0]
    assert first["resumed_at"] == first["t_fail"] + 1
    assert first["t_fail"] >= killed["step"]
    history = sorted(int(step) for step in status["account"]["history"])
    assert history == list(range(1, STEPS + 1))  # no step skipped or repeated

    store = LayerStore.open(config.storage_uri)
    after = {v.version_id: v for v in store.versions()}
    assert set(killed["committed"]) <= set(after), "a version committed before the node loss is gone"
    for version_id in killed["committed"]:
        assert store.check_version(after[version_id], deep=True) == [], version_id
    # writing went on after the loss, on what is left (the lost node's writer is not waited on)
    assert any(v.step > first["t_fail"] for v in after.values())
    assert {v.world_size for v in after.values() if v.step > first["t_fail"]} >= {1}
