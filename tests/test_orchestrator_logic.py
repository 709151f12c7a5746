"""The orchestrator's decision and bookkeeping pieces, driven one call at a time (no Ray)."""

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from layercheck.orchestrator.core.accounting import RunAccount
from layercheck.orchestrator.core.commit_path import CommitPath, ShardWritten
from layercheck.orchestrator.core.commit_tracker import CommitTracker
from layercheck.orchestrator.core.policy_service import PolicyService
from layercheck.orchestrator.core.recovery_events import AbandonIncomplete
from layercheck.orchestrator.core.run_config import load_run_config, parse_run_config
from layercheck.orchestrator.runtime.wire import from_wire, to_wire
from layercheck.orchestrator.store.manifest import ShardReceipt
from layercheck.policies.checkpoint_policy import LayerCheckPolicy
from layercheck.policies.config_loader import ConfigError
from layercheck.policies.configs import LayerCheckConfig
from layercheck.policies.decision import Reason
from layercheck.workers.shard import LayerShard, ParamSlice

LAYERS = ("embed", "block.0", "norm")


def service(world_size=2, **policy):
    config = LayerCheckConfig(
        **{"k0": 1.0, "k0_embed": 1.0, "smax": 100, "warmup_steps": 1, "threshold_schedule": "constant", **policy}
    )
    return PolicyService(LayerCheckPolicy(config, LAYERS), LAYERS, world_size)


def report(svc, step, rank, sums, counts=None):
    counts = counts or {name: 10 for name in LAYERS}
    return svc.report(step=step, rank=rank, lr=1e-3, abs_sums=dict(zip(LAYERS, sums)), counts=counts)


def test_decision_comes_when_the_last_rank_reports_and_drift_is_the_global_mean():
    svc = service()
    assert report(svc, 1, 0, [0, 0, 0]) is None
    assert report(svc, 1, 1, [0, 0, 0]).is_base  # warm-up ends at step 1
    for layer in svc.layers:
        svc.settled(layer, 2)  # the base's versions (taken after step 2) committed
    assert report(svc, 2, 1, [4.0, 1.0, 0.0]) is None
    decision = report(svc, 2, 0, [6.0, 1.0, 0.0])
    # embed: (6 + 4) / (10 + 10) = 0.5 < 1; then another 0.5 reaches the threshold
    assert svc.trace[-1].drift == {"embed": 0.5, "block.0": 0.1, "norm": 0.0}
    assert not decision
    report(svc, 3, 0, [10.0, 0, 0])
    assert report(svc, 3, 1, [0.0, 0, 0]).reasons == {"embed": Reason.DRIFT}
    assert svc.last_complete_step == 3 and svc.decision(3) is not None


def test_duplicate_and_out_of_world_reports():
    svc = service()
    report(svc, 1, 0, [0, 0, 0])
    assert report(svc, 1, 0, [9, 9, 9]) is None  # the same rank again changes nothing
    assert report(svc, 1, 1, [0, 0, 0]) is not None
    assert report(svc, 1, 1, [0, 0, 0]) == svc.decision(1)  # a late retry gets the same decision
    with pytest.raises(ValueError, match="outside the world"):
        report(svc, 2, 5, [0, 0, 0])


def test_restart_rebases_the_policy_on_the_composite():
    svc = service(smax=5)
    for step in range(1, 4):
        report(svc, step, 0, [3, 3, 3])
        report(svc, step, 1, [3, 3, 3])
    report(svc, 4, 0, [0.1, 0.1, 0.1])  # rank 1 died before reporting step 4
    svc.restart(world_size=1, resume_after=3, persisted_steps={"embed": 2, "block.0": 1, "norm": 2})
    state = svc.policy.state_dict()
    assert state["last_persisted"] == {"embed": 2, "block.0": 1, "norm": 2}
    assert state["accumulated"] == {name: 0.0 for name in LAYERS}
    assert svc.last_complete_step == 3
    # the new one-rank group reports step 4 afresh; block.0 is 5 steps stale at step 6
    report(svc, 4, 0, [0, 0, 0])
    report(svc, 5, 0, [0, 0, 0])
    assert report(svc, 6, 0, [0, 0, 0]).reasons == {"block.0": Reason.STALENESS}


def test_restart_without_a_composite_starts_over_and_rewrites_the_base():
    svc = service(warmup_steps=2)
    for step in (1, 2, 3):
        report(svc, step, 0, [0, 0, 0])
        report(svc, step, 1, [0, 0, 0])
    svc.restart(world_size=2, resume_after=0, persisted_steps={})
    assert svc.last_complete_step == 0 and svc.trace == []
    report(svc, 1, 0, [0, 0, 0])
    assert not report(svc, 1, 1, [0, 0, 0])
    report(svc, 2, 0, [0, 0, 0])
    assert report(svc, 2, 1, [0, 0, 0]).is_base


def receipt(layer, step, rank, world_size=2):
    return ShardReceipt(
        layer=layer,
        step=step,
        rank=rank,
        world_size=world_size,
        base=False,
        path=f"layers/{layer}/{step}-{rank}",
        nbytes=10,
        checksum="0",
    )


def test_commit_tracker_waits_for_every_rank_and_abandons_superseded_versions():
    tracker = CommitTracker()
    assert tracker.add(receipt("embed", 5, 0)) is None
    assert tracker.add(receipt("embed", 7, 1)) is None  # rank 0's step-7 shard is still queued
    whole = tracker.add(receipt("embed", 7, 0))
    assert [r.rank for r in whole] == [0, 1]
    tracker.committed("embed", 7)
    assert tracker.incomplete == 0 and tracker.abandoned == 1  # step 5 never completes
    assert tracker.add(receipt("embed", 5, 1)) is None  # late, older than what is committed
    tracker.add(receipt("norm", 9, 0))
    assert tracker.forget_incomplete() == 1


def test_account_drops_lost_steps_from_productive_time():
    account = RunAccount(started=0.0)
    for step in range(1, 6):
        account.step_done(step, compute_s=1.0, stall_s=0.25 if step == 2 else 0.0, now=float(step), loss=5.0 - step)
    recovery = account.failed(t_fail=4, resumed_at=5, now=12.0)
    assert recovery.detect_restart_s == 7.0 and recovery.steps_redone == 0
    assert account.productive_s == 4.0 and account.lost_step_seconds == 1.0
    assert sorted(account.history) == [1, 2, 3, 4]
    assert account.ettr(now=20.0) == pytest.approx(0.2)
    assert account.stall_seconds == 0.25 and account.stalls == 1
    again = account.failed(t_fail=4, resumed_at=1, now=13.0)  # no composite: start over
    assert again.steps_redone == 4 and account.productive_s == 0.0


def test_wire_round_trip_is_exact_and_keeps_empty_shards():
    tensors = {k: torch.randn(6) for k in ("fp32", "exp_avg", "exp_avg_sq")}
    shard = LayerShard(
        layer="block.0",
        step=3,
        rank=1,
        world_size=2,
        slices=(ParamSlice("a", (2, 4), 2, 6),),
        tensors=tensors,
        optimizer_step=3,
        groups=({"name": "block.0/decay", "lr": 1e-3},),
    )
    wire = to_wire(shard, base=True)
    for a in wire.arrays.values():
        a.setflags(write=False)  # as the object store hands them out
    back = from_wire(wire)
    assert wire.base and back.slices == shard.slices and back.groups == shard.groups
    for key in tensors:
        assert torch.equal(back.tensors[key], tensors[key])
    empty = LayerShard(
        layer="norm",
        step=3,
        rank=1,
        world_size=2,
        slices=(),
        tensors={k: torch.empty(0) for k in tensors},
        optimizer_step=3,
    )
    assert from_wire(to_wire(empty, base=False)).numel == 0
    assert isinstance(wire.arrays["fp32"], np.ndarray)


def test_example_configs_load_and_bad_values_name_the_field(tmp_path):
    config = load_run_config("examples/demo.toml")
    assert config.engine.zero_stage == 3 and config.cluster.num_workers == 2 and config.fault.kill_at_step > 0
    assert parse_run_config(config.to_json()) == config  # what the workers receive
    for overrides, field in [
        ({"policy.period": -1}, "policy.period"),
        ({"engine.zero_stage": 7}, "zero_stage"),
        ({"stepz": 3}, "stepz"),
        ({"policy.ema": float("inf")}, "policy.ema"),
        ({"policy.k0": 1e-3}, "policy: unknown key"),  # the demo's staggered schedule has no threshold
        ({"policy.name": "sometimes"}, "policy.name"),
        ({"cluster.max_failures": -1}, "max_failures"),
        ({"fault.stall_writes_s": float("nan")}, "stall_writes_s"),
        ({"fault.stall_writes_s": -1.0}, "stall_writes_s"),
    ]:
        with pytest.raises(ConfigError, match=field):
            load_run_config("examples/demo.toml", overrides)
    (tmp_path / "x.yaml").write_text("steps: 5\nmodel: {hf_config: {model_type: llama}}\npolicy: {name: never}\n")
    assert load_run_config(tmp_path / "x.yaml").policy_name == "never"
    with pytest.raises(ConfigError, match="model"):
        parse_run_config({"steps": 3})
    with pytest.raises(ConfigError, match="cannot read"):
        load_run_config(tmp_path / "missing.toml")
    assert math.isfinite(config.optim.lr)


def test_an_injected_write_stall_hits_the_chosen_nodes_writers_after_the_chosen_step():
    fault = load_run_config(
        "examples/demo.toml",
        {"fault.stall_writes_s": 2.5, "fault.stall_writes_node": "n2", "fault.stall_writes_after_step": 6},
    ).fault
    assert [fault.stall_s(node_id=n, step=s) for n, s in (("n2", 7), ("n2", 6), ("n1", 7))] == [2.5, 0.0, 0.0]
    anywhere = load_run_config("examples/demo.toml", {"fault.stall_writes_s": 1.0}).fault
    assert anywhere.stall_s(node_id="n1", step=1) == 1.0
    assert load_run_config("examples/demo.toml").fault.stall_s(node_id="n1", step=99) == 0.0


def test_relative_storage_is_made_absolute_for_the_workers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_run_config(Path(__file__).resolve().parent.parent / "examples/demo.toml")
    assert config.storage_uri == "runs/demo"
    assert config.with_absolute_storage().storage_uri == str(tmp_path / "runs/demo")
    remote = parse_run_config({**config.to_json(), "storage": "s3://bucket/run"})
    assert remote.with_absolute_storage().storage_uri == "s3://bucket/run"


def test_corrupt_shard_error_survives_pickling():
    import pickle

    from layercheck.orchestrator.store.errors import CorruptShardError

    error = pickle.loads(pickle.dumps(CorruptShardError(version_id="v", path="p", reason="missing")))
    assert (error.version_id, error.path, error.reason) == ("v", "p", "missing") and "missing" in str(error)


def test_superseding_queue_keeps_one_pending_shard_per_layer_and_rank():
    from layercheck.orchestrator.core.write_queue import SupersedingQueue

    queue = SupersedingQueue(lambda item: item[1])
    assert queue.put(("embed", 0), ("embed@5", 100)) is None
    assert queue.put(("norm", 0), ("norm@5", 1)) is None
    assert queue.put(("embed", 1), ("embed@5 rank1", 100)) is None
    assert queue.put(("embed", 0), ("embed@9", 100)) == ("embed@5", 100)  # superseded, never written
    assert len(queue) == 3 and queue.nbytes == 201
    assert [queue.pop()[0] for _ in range(3)] == ["norm@5", "embed@5 rank1", "embed@9"]
    assert queue.pop() is None and queue.nbytes == 0


def test_a_lost_groups_incomplete_versions_up_to_t_fail_are_committed_as_partial_versions():
    commits = CommitPath(layers=["embed", "norm"])
    assert commits.handle(ShardWritten(receipt=receipt("embed", 6, 0))) == []  # rank 1 died before writing
    assert commits.handle(ShardWritten(receipt=receipt("norm", 7, 0))) == []  # past t_fail = 6
    captured = dataclasses.replace(receipt("norm", 6, 0), origin="capture")
    assert commits.handle(ShardWritten(receipt=captured)) == []  # never merged with a policy snapshot
    actions = commits.handle(AbandonIncomplete(reason="group lost", keep_upto=6))
    assert sorted((a.receipts[0].layer, a.receipts[0].origin, a.partial) for a in actions) == [
        ("embed", "policy", True),
        ("norm", "capture", True),
    ]
    assert commits.tracker.incomplete == 0 and commits.tracker.abandoned == 3  # as whole versions, all three
