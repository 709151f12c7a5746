"""A real two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head and a
second node, one logical CPU each, so the two workers land one per node); the second node is
removed mid-run (its raylet, its worker and its writer actor die with it). The elastic group
(``cluster.min_workers = 1``) resumes at ``t_fail + 1`` on the head alone, nothing committed is
lost, and new versions are written by the head's writer; when a node returns, Ray Train grows
the group back (a restart LayerCheck resumes like a recovery, every rank at ``t_fail + 1``). Also:
the same cluster refuses a node-local storage path unless ``cluster.shared_storage`` says it is
shared; and with ``cluster.in_place`` and a third node, the lost node's rank alone is replaced, on
the third, while the survivor keeps its process."""

import json
import os
import shutil
import threading
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from layercheck.orchestrator.core.recovery.config import SupervisionConfig
from layercheck.orchestrator.core.run_config import load_run_config
from layercheck.orchestrator.runtime.cluster import connect
from layercheck.orchestrator.runtime.driver import train
from layercheck.orchestrator.runtime.names import NAMESPACE, RunNames
from layercheck.orchestrator.runtime.run_summary import summarize
from layercheck.orchestrator.store.errors import UnsafeStoreError
from layercheck.orchestrator.store.fs import TMP_SUFFIX
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import LAYERS_DIR
from layercheck.workers.faults import FAULTS_ENV
from tests.support.faults import FaultPlan, env_spec, injected
from tests.support.ray_runs import private_ray_tmp

pytestmark = pytest.mark.slow

KILL_AFTER_STEP = 8
STEPS = 40
#: Growing back: an upper bound only. The 1-worker phase must outlast Ray Train's view of the
#: cluster (its autoscaling coordinator refreshes every 20 s) and cluster.resize_check_s, however
#: fast the steps are; the test stops the run (as Ctrl-C does) once the grown group has trained
#: GROWN_STEPS steps.
REGROW_STEPS = 5000
GROWN_STEPS = 8
STOP_REASON = "the test saw the group grow back"
#: A hang guard, not a timing check: a run that has not grown back and trained by then is stopped
#: (so the test fails with what it saw instead of hanging).
GIVE_UP_S = 600
#: The lost node's stalled writes: every layer has a whole version by STALL_AFTER_STEP (period 4);
#: each later write would take STALL_S, longer than the recovery's drain deadline.
STALL_AFTER_STEP = 6
STALL_S = 120.0


#: Ray's health checks of the nodes: a lost node is known dead after 3 failed checks 1 s apart. Ray's
#: default, 5 failed checks 3 s apart, took 14.3 s of a recovery in place (25.9 s from the death to
#: the next step, against 10.9 s with these; docs/in-place-recovery.md)
FAST_NODE_DEATH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    # Ray Train waits this long for a group it cannot place (after the loss it first asks for two
    # workers again) before it retries smaller; 60 s by default. Propagated to its controller.
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "20")
    # Ray's files in a folder of this cluster's own: Cluster writes the address file that a bare
    # ray.init() joins (layercheck's connect too), which in the default folder would take other
    # tests running beside this one (pytest-xdist) into this cluster
    temp = private_ray_tmp()
    mp.setenv("RAY_TMPDIR", str(temp))
    mp.setenv(FAULTS_ENV, env_spec())  # the test injector in every process of the cluster (tests/support/faults.py)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": FAST_NODE_DEATH})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    mp.undo()
    shutil.rmtree(temp, ignore_errors=True)


def _second_node(cluster):
    """The cluster's worker node, added if an earlier test removed it."""
    second = next(iter(cluster.worker_nodes), None) or cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    return second


def _config(cluster, tmp_path, name, **overrides):
    steps = overrides.pop("steps", STEPS)
    return load_run_config(
        "examples/demo.toml",
        {
            "name": name,
            "storage": str(tmp_path / name),
            "steps": steps,
            "optim.total_steps": steps,
            "optim.warmup_steps": 2,
            "policy.warmup_steps": 2,
            "policy.period": 4,  # every layer has a version well before the node is lost
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
    head = cluster
    _second_node(head)
    with pytest.raises(UnsafeStoreError, match="cluster.shared_storage = true"):
        train(_config(head, tmp_path, "refused"))
    assert not (tmp_path / "refused").exists()


def _lose_a_node(head, second, config, seen, *, bring_back=False, kill_after=KILL_AFTER_STEP):
    """An ``on_progress`` that removes ``second`` after ``kill_after``, once the group has both
    workers (and, with ``bring_back``, adds a node once the loss is recovered from, and stops the
    run once the group grown back has trained GROWN_STEPS steps), recording what it saw in ``seen``.

    Ray Train may start the group with one worker (its view of the cluster is refreshed every 20 s
    and is older than a node an earlier test added) and grow it at once: not the loss."""
    lock = threading.Lock()

    def on_progress(status):
        with lock:
            try:
                seen["run_id"] = status["run_id"]
                if "committed" not in seen and status.get("step", 0) >= kill_after and _two_workers(status):
                    _record_mirrors(head, config, status, seen)
                    seen["committed"] = {v.version_id: v for v in LayerStore.open(config.storage_uri).versions()}
                    seen["killed_at"] = status["step"]
                    seen["recoveries_before"] = len(status["account"]["recoveries"])
                    seen["memory_at_loss"] = ray.get(_supervisor(status["run_id"]).memory_view.remote())
                    head.remove_node(second, allow_graceful=False)  # raylet, worker, writer: gone at once
                elif bring_back and "committed" in seen and "returned" not in seen and _trained_alone(status, seen):
                    seen["returned"] = status["step"]  # the test's main thread adds the node (signals)
                elif bring_back and "returned" in seen and "stopped" not in seen and _trained_grown(status, seen):
                    seen["stopped"] = status["step"]
                    _request_stop(status["run_id"], STOP_REASON)
            except Exception as error:  # the driver's progress poll swallows errors: keep it for the test
                seen.setdefault("errors", []).append(repr(error))

    return on_progress


def _record_mirrors(head, config, status, seen) -> None:
    """How many shard files of each layer's newest committed version the head's writers do not
    hold (their own, and the mirror copies of the second node's), just before the loss."""
    if not config.persistence.memory_mirror:
        return
    newest: dict = {}  # per layer, the newest committed version: what a recovery would load (writers keep only it)
    for version in LayerStore.open(config.storage_uri).versions():
        if not version.partial and version.step >= newest.get(version.layer, version).step:
            newest[version.layer] = version
    paths = {e.path for v in newest.values() for e in v.shards}
    index = ray.get(_supervisor(status["run_id"]).memory_index.remote(head.head_node.node_id))
    seen["mirror_missing_at_loss"] = sorted(
        p for p in paths if not any(source == "memory_local" for source, _ in index.get(p, []))
    )


def _supervisor(run_id):
    return ray.get_actor(RunNames(run_id).supervisor, namespace=NAMESPACE)


def _request_stop(run_id, reason):
    """What Ctrl-C on the driver does: every rank stops after the same step."""
    ray.get(_supervisor(run_id).request_stop.remote(reason))


def _two_workers(status):
    return status["state"] == "running" and status["world_size"] == 2


def _since_the_loss(status, seen):
    """The recoveries from the node's loss on (the first is the loss's)."""
    return status["account"]["recoveries"][seen["recoveries_before"] :]


def _trained_alone(status, seen):
    """The group resumed after the loss and has trained a few steps with what was left."""
    recoveries = _since_the_loss(status, seen)
    return bool(recoveries) and status.get("step", 0) >= recoveries[0]["resumed_at"] + 5


def _trained_grown(status, seen):
    """The group grew back after the loss and trained GROWN_STEPS steps."""
    grown = [r for r in _since_the_loss(status, seen)[1:] if r["grown_from"]]
    return bool(grown) and status.get("step", 0) >= grown[-1]["resumed_at"] + GROWN_STEPS


def _check_recovered_from_the_loss(result, config, seen, steps):
    assert not seen.get("errors"), seen["errors"]
    assert "committed" in seen, "the run ended before the node was removed"
    status = result.status
    if "stopped" in seen:  # stopped by the test once the group had grown back: every rank after the same step
        assert status["stop_reason"] == STOP_REASON and result.error.startswith("stopped after step"), result.error
        steps = status["step"]
    else:
        assert result.error is None, result.error
        assert status["state"] == "finished"
    for recovery in status["account"]["recoveries"]:  # a group grown before any step restarts at 1
        assert recovery["resumed_at"] == recovery["t_fail"] + 1
    recoveries = _since_the_loss(status, seen)
    assert recoveries, "the node's loss was not recovered from"
    lost = recoveries[0]
    assert lost["t_fail"] >= seen["killed_at"] and not lost["grown_from"], recoveries
    # every step after the loss trained once (the lost node's rank may take its last progress
    # messages of the steps before t_fail with it: the history is rank 0's progress)
    history = {int(step) for step in status["account"]["history"]}
    assert set(range(lost["resumed_at"], steps + 1)) <= history and max(history) == steps

    store = LayerStore.open(config.storage_uri)
    after = {v.version_id: v for v in store.versions()}
    assert set(seen["committed"]) <= set(after), "a version committed before the node loss is gone"
    for version_id in seen["committed"]:
        assert store.check_version(after[version_id], deep=True) == [], version_id
    # the group went on with one worker (the head's writer; the lost node's is not waited on)
    sizes = [(v.step, v.world_size) for v in after.values() if v.step > lost["t_fail"]]
    assert any(size == 1 for _, size in sizes), sizes
    return recoveries, sizes


def test_losing_a_node_resumes_at_t_fail_plus_one_from_memory_and_loses_nothing_committed(cluster, tmp_path):
    """The second node is lost mid-run, and its storage hangs before that (the test injector's
    ``stall_writes_*``: each write of a version taken after STALL_AFTER_STEP pauses STALL_S
    mid-file), so at the loss
    its writer holds versions it has not written: the elastic group resumes at ``t_fail + 1`` on the
    head; nothing committed is lost; the dead writer's versions are written off at once (no wait for
    them, nor for the drain deadline) and counted lost, and its temporary files are no obstacle; the
    survivor's capture and the writers' memory (the lost node's files mirrored to the head) serve the
    recovery."""
    head, second = cluster, _second_node(cluster)
    # no memory versions (the default's): the lost rank's slices from the stored versions' mirror copies
    config = _config(head, tmp_path, "stalled", **{"cluster.shared_storage": True, "persistence.memory_period": 0})
    stall = FaultPlan(
        stall_writes_s=STALL_S, stall_writes_node=second.node_id, stall_writes_after_step=STALL_AFTER_STEP
    )
    seen: dict = {}
    on_progress = _lose_a_node(head, second, config, seen, kill_after=STALL_AFTER_STEP + 4)
    with injected(stall):
        result = train(config, on_progress=on_progress, poll_s=0.2)
    recoveries, _ = _check_recovered_from_the_loss(result, config, seen, STEPS)
    status, lost = result.status, recoveries[0]
    # not waited on: neither for the stalled writes nor for the drain's deadline
    assert lost["plan_s"] < SupervisionConfig().drain_deadline_s < STALL_S, lost
    # what the lost node's writer held is counted lost, with its reason (the summary shows it)
    assert status["lost_versions"] >= 1, status["lost"]
    assert any(f"@{second.node_id[:8]}" in reason for reason in status["lost"]), (second.node_id, status["lost"])
    assert summarize(result)["lost_versions"] == status["lost_versions"]
    # recovery from memory: the survivor (the rank on the head) captured its slices at t_fail, and the
    # lost node's shard files came from the copies its writer mirrored to the head's writer
    account = status["account"]
    assert lost["elements"]["capture"] > 0, lost["elements"]
    held = [c["rank"] for c in account["capture"]["captures"] if c["held"]]
    assert len(held) == 1 and account["capture"]["holds"][0]["captured"] == held, account["capture"]
    # (a file the lost node wrote just before it vanished may not have reached its mirror yet)
    # (what the writers held just before the loss is in the message: mirror_bytes 0 means no mirror arrived)
    # checked last (below): the lost rank's files came from memory, not storage
    from_memory = lost["memory_local_shards"] > 0 and lost["storage_shards"] < lost["memory_local_shards"]
    memory_report = json.dumps(
        {
            "memory_at_loss": seen["memory_at_loss"],
            "newest_files_not_on_the_head_at_loss": seen.get("mirror_missing_at_loss"),
            "recovery": {k: v for k, v in lost.items() if k != "sources"},
        },
        default=str,
    )
    # no half-written version in the manifest: the stalled writer finished no version taken after
    # STALL_AFTER_STEP in the two-node group; what the surviving rank wrote of those versions (and
    # its capture) is committed as partial versions of its own slices only, and every record is whole
    store = LayerStore.open(config.storage_uri)
    versions = store.versions()
    late = [v for v in versions if v.world_size == 2 and v.step > STALL_AFTER_STEP]
    # (the survivor is the rank Ray Train placed on the head: rank 0 or 1)
    assert all(v.partial and [s.rank for s in v.shards] == held for v in late), (held, [v.version_id for v in late])
    for version in versions:
        assert store.check_version(version, deep=True) == [], version.version_id
    # the lost writer's temporaries are still there (it died mid-write); recovery planned past them
    strays = [rel for rel, _ in store.fs.list_files(LAYERS_DIR, recursive=True) if rel.endswith(TMP_SUFFIX)]
    assert strays, "the stalled writer left no temporary file: it was not mid-write at the loss"
    # every layer is in the composite: a layer whose first version the lost writer still held
    # (it may lag the steps) comes from the run's rebuilt initial state, staleness from step 0
    assert set(lost["sources"]) == set(result.layer_numel), lost["sources"]
    stored = {v.layer for v in versions if v.step <= lost["t_fail"] and not v.partial}
    initial = {layer for layer, sources in lost["sources"].items() if sources[-1]["origin"] == "initial"}
    assert initial == set(result.layer_numel) - stored, (initial, stored)
    # (it once failed one run in four: a stale assignment of mirror peers left the second node's
    # writer with none; writer_pool._assign_peers now numbers them)
    assert from_memory, f"the lost node's mirror copies were not on the head: {memory_report}"


@pytest.mark.skipif(
    os.environ.get("LAYERCHECK_TEST_REGROW") != "1",
    reason="slow, not flaky (LAYERCHECK_TEST_REGROW=1 runs it): 2.2-3.6 min here, most of it Ray Train's own "
    "waits (a 2-worker start timing out after the loss, its cluster view refreshed every 20 s before it "
    "grows); it passed 5 of 5 runs since the fix of the stall it once showed (a grown group's new rank 1 "
    "joined the old attempt and resumed at that attempt's step while rank 0 resumed at t_fail + 1)",
)
def test_the_group_grows_back_when_a_node_returns(cluster, tmp_path):
    """Ray Train v2's elastic policy resizes a running group every ``resize_check_s`` when its
    autoscaling coordinator sees room; growing restarts the group, which LayerCheck resumes, every
    rank at ``t_fail + 1`` whichever joins first (a new rank 1 once joined the old group and trained
    other steps than rank 0: the run stalled)."""
    head, second = cluster, _second_node(cluster)
    config = _config(
        head, tmp_path, "regrow", **{"cluster.shared_storage": True, "cluster.resize_check_s": 5, "steps": REGROW_STEPS}
    )
    seen: dict = {}
    on_progress = _lose_a_node(head, second, config, seen, bring_back=True)
    connect(config)  # here: train() runs in a thread, and Cluster.add_node must run in the main one
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(result=train(config, on_progress=on_progress, poll_s=0.2)))
    runner.start()
    deadline = time.monotonic() + GIVE_UP_S
    while runner.is_alive() and "returned" not in seen and time.monotonic() < deadline:
        time.sleep(0.2)
    if "returned" in seen:
        head.add_node(num_cpus=1)  # room for the second worker again
        seen["alive_after_return"] = sum(1 for n in ray.nodes() if n["Alive"])
    runner.join(timeout=max(0.0, deadline - time.monotonic()))
    if runner.is_alive() and "run_id" in seen:  # not grown back, or stalled: end it to see why
        _request_stop(seen["run_id"], "the test gave up waiting for the group to grow back")
    runner.join(timeout=300)  # the stop, the final saves and the drain
    assert not runner.is_alive(), f"the run did not end when asked to stop (stalled?); saw {seen}"
    recoveries, sizes = _check_recovered_from_the_loss(outcome["result"], config, seen, REGROW_STEPS)
    assert seen.get("alive_after_return") == 2, seen
    assert "stopped" in seen, f"the group did not grow back (node returned after step {seen.get('returned')})"
    grown = recoveries[-1]
    assert (grown["grown_from"], grown["world_size"]) == (1, 2), recoveries
    assert outcome["result"].status["account"]["failures"] == 1  # the node's loss; growing back is none
    assert any(size == 2 for step, size in sizes if step > grown["t_fail"]), sizes


def _nodes_of_the_group() -> set[str]:
    """The nodes of the run's Ray Train worker group (its placement group's bundles)."""
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    return {node for g in groups for node in g["bundles_to_node_id"].values()}


def test_losing_a_node_in_place_replaces_its_rank_on_another_node_and_the_survivor_keeps_its_process(cluster, tmp_path):
    """``cluster.in_place`` on three nodes of one CPU (the head, the second, a third): the node of a
    rank that is not on the head is lost mid-run. Ray Train replaces that rank only, on the node
    with room (it may first fail to start one, before the node's death is known, and retries); the
    replacement loads its slices from the writers' memory (the mirror copies on a surviving node) or
    storage. The survivor keeps its process and its state; every rank resumes at ``t_fail + 1`` with
    the group at its full size, and nothing committed is lost.
    (The elastic group that shrinks onto what is left: the test above.)"""
    head = cluster
    _second_node(head)
    third = head.add_node(num_cpus=1)
    head.wait_for_nodes()
    config = _config(
        head,
        tmp_path,
        "in-place",
        # no memory versions (the default's): the lost rank's slices from stored versions, as it checks
        **{
            "cluster.shared_storage": True,
            "cluster.in_place": True,
            "cluster.min_workers": 0,
            "persistence.memory_period": 0,
        },
    )
    seen: dict = {}
    lock = threading.Lock()

    def on_progress(status):
        with lock:
            try:
                if "killed_at" in seen or status.get("step", 0) < KILL_AFTER_STEP or not _two_workers(status):
                    return
                nodes = {n.node_id: n for n in head.worker_nodes}
                placed = [node for node in _nodes_of_the_group() if node in nodes]
                if not placed:
                    return
                seen["committed"] = {v.version_id for v in LayerStore.open(config.storage_uri).versions()}
                seen["killed_at"], seen["lost_node"] = status["step"], placed[0]
                head.remove_node(nodes[placed[0]], allow_graceful=False)
            except Exception as error:  # the driver's progress poll swallows errors: keep it for the test
                seen.setdefault("errors", []).append(repr(error))

    try:
        result = train(config, on_progress=on_progress, poll_s=0.2)
    finally:  # the module's cluster back to two nodes for the next test
        if "lost_node" not in seen:
            head.remove_node(third)
    assert not seen.get("errors"), seen["errors"]
    assert "killed_at" in seen, "the run ended before a node was removed"
    assert result.error is None, result.error
    status = result.status
    (recovery,) = status["account"]["recoveries"]
    assert recovery["t_fail"] >= seen["killed_at"] and recovery["resumed_at"] == recovery["t_fail"] + 1, recovery
    assert recovery["path"] == "in place" and recovery["kept_processes"] == 1, recovery
    history = {int(step) for step in status["account"]["history"]}
    assert set(range(recovery["resumed_at"], STEPS + 1)) <= history and max(history) == STEPS
    store = LayerStore.open(config.storage_uri)
    after = {v.version_id: v for v in store.versions()}
    assert seen["committed"] <= set(after), "a version committed before the node loss is gone"
    # the group kept its size: whole versions of both ranks after the loss
    assert any(v.world_size == 2 and not v.partial for v in after.values() if v.step > recovery["t_fail"])
    # the survivor's slices are its own state at t_fail; the lost rank's came from a writer's memory
    # (the head's mirror copies) or, for a file that had not reached its mirror yet, from storage
    assert recovery["elements"]["capture"] > 0 and recovery["elements"]["stored"] > 0, recovery["elements"]
    assert recovery["memory_local_shards"] + recovery["memory_remote_shards"] > 0, recovery
    assert recovery["failure_to_step_s"] > 0 and recovery["fallback"] == "", recovery
