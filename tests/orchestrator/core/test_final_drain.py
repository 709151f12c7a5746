"""The end of a run on storage that hangs: the final drain waits at most
``persistence.stop_drain_s`` after the last step, what the writers still hold then is counted lost
(named, once each) and never committed or counted as written afterwards, and the driver prints
its summary and exits. The core without Ray; then ``layercheck train`` on S3 behind an endpoint
that stops answering (slow)."""

import re
import time

import pytest

from layercheck.orchestrator.core.policy_service import PolicyService
from layercheck.orchestrator.core.run_checks import check_model
from layercheck.orchestrator.core.run_config import load_run_config
from layercheck.orchestrator.core.run_supervisor import RunSupervisor
from layercheck.orchestrator.core.supervision_ports import LocalPolicy
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.policies.checkpoint_policy import LayerCheckPolicy
from layercheck.policies.configs import LayerCheckConfig
from layercheck.workers.progress import StepProgress
from tests.support.clock import ManualClock
from tests.support.s3_server import FAST_FAIL
from tests.support.store_helpers import written_receipts
from tests.support.train_proc import start_train

LAYERS = ("embed", "block.0", "norm")
DRAIN_S = 3.0


class HungWriters:
    """A writer that never answers the drain and still holds shards of ``held`` ``(layer, step)``
    (both ranks' of embed: two shards, one version)."""

    def __init__(self, held):
        self.held = held
        self.deadlines = []

    def drain(self, deadline_s):
        self.deadlines.append(deadline_s)  # (a real pool waits this long, then names who did not answer)
        return ("writer-0",)

    def unfinished(self, names):
        assert names == ("writer-0",)
        return list(self.held)

    def replace(self, names):
        pass


def test_a_hanging_final_drain_ends_its_bound_after_the_last_step_and_counts_what_is_left_lost(tmp_path):
    clock = ManualClock(0.0)
    store = LayerStore.open(str(tmp_path / "store"))
    writers = HungWriters([("embed", 6), ("embed", 6), ("block.0", 6)])
    config = LayerCheckConfig(k0=1e9, k0_embed=1e9, smax=1000, warmup_steps=1, threshold_schedule="constant")
    service = PolicyService(LayerCheckPolicy(config, LAYERS), LAYERS, 2)
    run = RunSupervisor(
        run_id="r",
        store=store,
        layer_numel={n: 42 for n in LAYERS},
        policy=LocalPolicy(service),
        writers=writers,
        clock=clock,
    )
    for number in range(1, 7):
        clock.now += 1.0
        run.progress(StepProgress(step=number, loss=1.0, lr=1e-3, compute_s=0.1, stall_s=0.0))
    for layer in LAYERS:  # step 1's versions were written and committed
        for receipt in written_receipts(store, layer, 1):
            run.shard_written(receipt, 0.01)
    clock.now += 1.0  # the ranks' own final hand-over took a second of the bound
    assert run.final_drain(DRAIN_S) == ("writer-0",)
    assert writers.deadlines == [DRAIN_S - 1.0]  # the bound counts from the last step
    status = run.status()
    assert status.versions_committed == len(LAYERS) and status.lost_versions == 2
    lost = " ".join(status.lost)
    assert "embed@6" in lost and "block.0@6" in lost and "stop_drain_s" in lost
    committed = {v.version_id for v in store.versions()}
    for receipt in written_receipts(store, "block.0", 6):  # the hung write lands after all
        run.shard_written(receipt, 0.01)
    assert {v.version_id for v in store.versions()} == committed  # counted lost, so never committed
    assert run.status().versions_committed == len(LAYERS) and run.status().lost_versions == 2


def test_a_final_drain_after_its_bound_asks_the_writers_without_waiting(tmp_path):
    clock = ManualClock(0.0)
    writers = HungWriters([])
    service = PolicyService(LayerCheckPolicy(LayerCheckConfig(smax=1000, warmup_steps=1), LAYERS), LAYERS, 2)
    run = RunSupervisor(
        run_id="r",
        store=LayerStore.open(str(tmp_path / "store")),
        layer_numel={n: 42 for n in LAYERS},
        policy=LocalPolicy(service),
        writers=writers,
        clock=clock,
    )
    run.progress(StepProgress(step=1, loss=1.0, lr=1e-3, compute_s=0.1, stall_s=0.0))
    clock.now += 10 * DRAIN_S  # the ranks' hand-over already waited the whole bound
    run.final_drain(DRAIN_S)
    assert writers.deadlines == [0.0] and run.status().lost_versions == 0


@pytest.mark.slow
def test_a_run_whose_storage_stops_answering_ends_within_its_drain_bound_naming_what_it_lost(tmp_path, ray_tmp, s3):
    """``layercheck train`` on S3; early on the endpoint starts to accept connections and never
    answer (a hung server or load balancer). The run trains on to its last step and its driver
    exits within a bound of it — the ranks' hand-over and the final drain each wait at most
    ``persistence.stop_drain_s`` after the last step, the end's store calls as long each — with
    the final versions it could not write counted lost and named, never as written."""
    steps, drain_s = 60, 4
    layers = check_model(load_run_config("examples/demo.toml").model).numel
    run = start_train(
        tmp_path,
        f"storage={s3.uri('runs/hang', **FAST_FAIL)}",
        f"steps={steps}",
        f"optim.total_steps={steps}",
        "policy.warmup_steps=2",
        "policy.period=2",
        "policy.smax=1000",  # no staleness breach stops it: the run ends by itself, on storage that hangs
        "fault.kill_at_step=0",
        "metrics.port=0",
        "log_every=1",
        f"persistence.stop_drain_s={drain_s}",
        ray_tmp=ray_tmp,
    )
    run.wait_for_step(3)
    s3.proxy.hang()
    run.wait_for_step(steps)
    last_step_seen = time.monotonic()
    out = run.finish(timeout=600)
    exited_after = time.monotonic() - last_step_seen
    err = run.stderr
    assert run.proc.returncode == 0, err[-3000:]
    # before: the ranks and then the drain each waited up to 300 s for writes that never return
    assert exited_after < 120, (exited_after, err[-3000:])
    # (every layer's final version, at least, was handed over and never written)
    named = re.search(r"(\d+) version\(s\) \(\w[^)]*@\d+[^)]*\): still in writer\(s\)", out)
    assert named is not None and int(named.group(1)) >= len(layers), out[-3000:]
    assert "stop_drain_s" in named.string[named.end() : named.end() + 200], out[-3000:]
