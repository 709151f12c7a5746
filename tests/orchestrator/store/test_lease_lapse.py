"""A run whose lease lapsed unrenewed writes and commits nothing more, without Ray: once the
expiry its driver last wrote has passed (storage that does not answer the renewals, a frozen
driver), another run may take the store over, so every shard write and commit is refused (a
refused write counts as a failed one) and the run stops with a reason naming the lease; a renewal
that reaches the store before the expiry changes nothing. The driver's side: a renewal that fails
leaves the lease valid until what the store holds, and the end of a run does not wait for a
renewal hung on storage."""

import threading

import pytest

from layercheck.orchestrator.core.policy_service import PolicyService
from layercheck.orchestrator.core.run_supervisor import RunSupervisor
from layercheck.orchestrator.core.supervision_ports import LocalPolicy
from layercheck.orchestrator.store.errors import LeaseLapsedError, StoreWriteError
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.lease import LEASE_FILE, StoreLease, read_lease
from layercheck.orchestrator.store.lease_term import LEASE_LAPSED, LeaseTerm
from layercheck.orchestrator.store.manifest import LAYERS_DIR
from layercheck.policies.checkpoint_policy import LayerCheckPolicy
from layercheck.policies.configs import LayerCheckConfig
from layercheck.workers.progress import StepProgress
from tests.support.clock import ManualClock
from tests.support.store_helpers import faulty_store, written_receipts

LAYERS = ("embed", "block.0", "norm")
TTL_S = 2.0
#: The Ray test's first lease term: a writer actor starts well within it, even on a loaded CI machine.
ACTOR_START_S = 12.0


class Writers:
    def drain(self, deadline_s):
        return ()

    def replace(self, names):
        pass


def make(tmp_path, clock):
    """A supervisor on a real store whose lease, as the driver last wrote it, expires at ``TTL_S``
    on ``clock``."""
    store = LayerStore.open(str(tmp_path / "store"))
    store.term = LeaseTerm(uri=store.uri, valid_until=TTL_S, clock=clock)
    config = LayerCheckConfig(k0=1e9, k0_embed=1e9, smax=1000, warmup_steps=1, threshold_schedule="constant")
    service = PolicyService(LayerCheckPolicy(config, LAYERS), LAYERS, 2)
    run = RunSupervisor(
        run_id="r",
        store=store,
        layer_numel={n: 42 for n in LAYERS},
        policy=LocalPolicy(service),
        writers=Writers(),
        clock=clock,
        sleep=lambda seconds: None,
    )
    return run, service, store


def step(run, service, number):
    for rank in (0, 1):
        service.report(
            step=number, rank=rank, lr=1e-3, abs_sums={n: 0.0 for n in LAYERS}, counts={n: 42 for n in LAYERS}
        )
    run.progress(StepProgress(step=number, loss=1.0, lr=1e-3, compute_s=0.1, stall_s=0.0))


def write(run, store, layer, number):
    """What a writer actor does with a version's shards (``writer_actor._write``): write each and
    hand its receipt over, or report the write failed."""
    try:
        receipts = written_receipts(store, layer, number)
    except Exception:
        run.write_failed(layer, number)
        return
    for receipt in receipts:
        run.shard_written(receipt, 0.01)


def files(tmp_path):
    return sorted((tmp_path / "store" / LAYERS_DIR).rglob("*.safetensors"))


def test_a_lapsed_lease_refuses_every_write_and_commit_counts_the_writes_failed_and_stops_the_run(tmp_path):
    clock = ManualClock(0.0)
    run, service, store = make(tmp_path, clock)
    step(run, service, 1)
    for layer in LAYERS:
        write(run, store, layer, 1)
    committed = {v.version_id for v in store.versions()}
    assert len(committed) == len(LAYERS) and run.status().stop_reason is None
    late = written_receipts(store, "embed", 2)  # written while the lease was valid, not committed yet
    clock.now = TTL_S  # no renewal reached the store in time: another run may take it over now
    before = files(tmp_path)
    write(run, store, "block.0", 2)  # refused before it touches the store
    assert files(tmp_path) == before
    for receipt in late:
        run.shard_written(receipt, 0.01)  # the commit is refused too, and not retried
    assert {v.version_id for v in store.versions()} == committed, "a run whose lease lapsed committed"
    status = run.status()
    assert status.write_failures == 1 and status.commit_retries == 0
    reason = status.stop_reason
    assert reason.startswith(LEASE_LAPSED) and store.uri in reason and "lapsed" in reason
    assert "\n" not in reason and service.stop_reason == reason
    run.lease_renewed(TTL_S + 60)  # a renewal that lands after the expiry does not revive the lease
    with pytest.raises(LeaseLapsedError):
        written_receipts(store, "norm", 3)


def test_a_lapsed_lease_stops_the_run_at_its_next_step_with_nothing_written(tmp_path):
    """Storage that hangs: no write fails, none finishes, and the renewals do not get through."""
    clock = ManualClock(0.0)
    run, service, _ = make(tmp_path, clock)
    step(run, service, 1)
    clock.now = TTL_S + 0.5
    step(run, service, 2)
    assert run.status().stop_reason.startswith(LEASE_LAPSED)
    assert service.stopping(3)


def test_a_lease_renewed_before_it_expires_is_not_disturbed(tmp_path):
    clock = ManualClock(0.0)
    run, service, store = make(tmp_path, clock)
    for number in range(1, 6):
        clock.now += TTL_S / 3
        run.lease_renewed(clock.now + TTL_S)  # each renewal reaches the store a third of the TTL after the last
        step(run, service, number)
        for layer in LAYERS:
            write(run, store, layer, number)
    assert clock.now > TTL_S  # well past the first expiry
    status = run.status()
    assert status.stop_reason is None and status.write_failures == 0 and status.lost_versions == 0
    assert status.versions_committed == 5 * len(LAYERS)


def test_a_failed_renewal_leaves_the_lease_valid_until_what_the_store_holds(tmp_path):
    store, handler = faulty_store(str(tmp_path))
    lease = StoreLease.acquire(store.fs, run="mine", ttl_s=60, settle_s=0)
    told: list[float] = []
    lease.on_renewed = told.append
    lease.renew()
    assert told == [read_lease(store.fs).expires_at]
    handler.read_only = True  # the renewal's write fails
    with pytest.raises(StoreWriteError):
        lease.renew()
    assert lease.info.expires_at == read_lease(store.fs).expires_at, "a failed renewal claims a later expiry"
    assert lease.valid_until == read_lease(store.fs).expires_at and told == [lease.valid_until]


def test_the_end_of_a_run_does_not_wait_for_a_renewal_hung_on_storage(tmp_path, monkeypatch):
    """The driver's release at the end returns after ``wait_s`` and leaves the lease to expire: a
    deletion now would be undone by the renewal, should it land later."""
    fs = StoreFS.open(str(tmp_path / "run"), fsync=False)
    lease = StoreLease.acquire(fs, run="mine", ttl_s=0.03)
    entered, answer = threading.Event(), threading.Event()
    write_bytes = StoreFS.write_bytes

    def hanging(self, rel, data):
        if rel == LEASE_FILE:
            entered.set()
            answer.wait()  # the endpoint accepts the request and never answers (until the test ends)
        return write_bytes(self, rel, data)

    monkeypatch.setattr(StoreFS, "write_bytes", hanging)
    lease.keep_alive()
    assert entered.wait(timeout=60)
    lease.release(wait_s=0.05)
    assert read_lease(fs).owner == lease.info.owner  # left to expire by itself
    answer.set()
    lease._thread.join(timeout=60)


@pytest.mark.slow
def test_writer_actors_write_while_their_lease_is_renewed_and_refuse_once_it_lapsed(local_ray, tmp_path):
    """The Ray wiring: the pool hands each renewal to its writers, and a writer started after the
    lease lapsed (or told of a renewal too late) refuses its writes and reports each one failed."""
    import math
    import time

    import ray

    from layercheck.orchestrator.runtime.wire import to_wire
    from layercheck.orchestrator.runtime.writer_pool import WriterPool
    from tests.support.store_helpers import PARAMS, cut_shards, even_cuts, layer_state

    @ray.remote(num_cpus=0)
    class Supervisor:
        def __init__(self):
            self.failed = []

        def shard_written(self, receipt, write_s):
            pass

        def write_failed(self, layer, step, rank, error):
            self.failed.append((layer, step, error))

        def failures(self):
            return self.failed

    total = sum(math.prod(s) for s in PARAMS.values())
    shard = cut_shards("block.0", 4, PARAMS, layer_state(PARAMS, seed=4), even_cuts(total, 2))[0]
    node = ray.get_runtime_context().get_node_id()
    sink = Supervisor.remote()
    # long enough for the actor to start and hear the renewal under a loaded machine (a renewal
    # that reaches it after the expiry is too late, by design); the test then waits past it
    expires = time.time() + ACTOR_START_S
    renewed = WriterPool(
        store_uri=str(tmp_path / "a"), fsync=False, per_node=1, supervisor=sink, lease_valid_until=expires
    )
    (writer,) = renewed.for_node(node)
    renewed.lease_renewed(expires + 600)  # a renewal reached the store
    ray.get(writer.get_stats.remote())  # the actor is up and, its calls being ordered, has the renewal
    assert time.time() < expires, "the writer actor took longer than ACTOR_START_S to start"
    time.sleep(max(0.0, expires - time.time()) + 0.1)  # past the expiry the writer started with
    assert ray.get(writer.submit.remote(to_wire(shard, base=False))) == "written"

    lapsed = WriterPool(
        store_uri=str(tmp_path / "b"), fsync=False, per_node=1, supervisor=sink, lease_valid_until=time.time() - 1
    )
    (late,) = lapsed.for_node(node)
    lapsed.lease_renewed(time.time() + 600)  # too late
    outcome = ray.get(late.submit.remote(to_wire(shard, base=False)))
    assert outcome.startswith("failed: ") and "lapsed" in outcome
    assert [(layer, step) for layer, step, _ in ray.get(sink.failures.remote())] == [("block.0", 4)]
    assert not (tmp_path / "b" / LAYERS_DIR).exists()
    for actor in (writer, late, sink):
        ray.kill(actor)
