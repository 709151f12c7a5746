"""A recovery plans from the versions the supervisor knows (the store's, read as the run starts,
and every commit since) and reads no manifest: listing ``manifest/`` and reading every record grew
with the run's length (``bench/scale``'s plan over many versions)."""

import pytest

from layercheck.orchestrator.core.recovery.known_versions import KnownVersions
from layercheck.orchestrator.store import layer_store
from tests.orchestrator.core.test_run_supervisor import LAYERS, Writers, make, persist_all, train
from tests.support.store_helpers import written_receipts


@pytest.fixture
def manifest_reads(monkeypatch):
    """Counts every read of a store's manifest (a listing of ``manifest/`` and a read of each record)."""
    reads = []
    read = layer_store.read_manifest

    def counted(fs, *args, **kwargs):
        reads.append(fs.uri())
        return read(fs, *args, **kwargs)

    monkeypatch.setattr(layer_store, "read_manifest", counted)
    return reads


def test_a_recovery_plans_from_the_versions_the_supervisor_committed_without_reading_the_manifest(
    store, manifest_reads
):
    run, service = make(store, Writers())
    run.join(0, 2, "a0"), run.join(1, 2, "a1")
    assert len(manifest_reads) <= 1  # (the start reads the store's history, once)
    train(service, range(1, 6))
    persist_all(run, store, 3)
    persist_all(run, store, 5)
    before = len(manifest_reads)
    resume = run.join(1, 2, "b1")  # the group was lost after step 5
    assert resume.start_step == 6 and {r.step for r in resume.records.values()} == {5}
    assert run.join(0, 2, "b0") == resume
    assert len(manifest_reads) == before
    assert {r.version_id for r in resume.records.values()} <= {r.version_id for r in store.versions()}


def test_what_the_store_held_at_the_start_is_planned_from_too(store, manifest_reads):
    """A restarted driver's supervisor: the versions an earlier driver committed are in the store."""
    for layer in LAYERS:
        store.commit(list(written_receipts(store, layer, 2)))
    run, service = make(store, Writers())
    run.join(0, 2, "a0"), run.join(1, 2, "a1")
    train(service, range(1, 5))
    for receipt in written_receipts(store, "embed", 4):  # this run commits embed only
        run.shard_written(receipt, 0.01)
    before = len(manifest_reads)
    resume = run.join(0, 2, "b0")
    assert {layer: r.step for layer, r in resume.records.items()} == {"embed": 4, "block.0": 2, "norm": 2}
    assert len(manifest_reads) == before == 1


def test_a_commit_during_the_first_read_is_kept(store):
    known = KnownVersions()
    record = store.commit(list(written_receipts(store, "embed", 1)))
    known.committed(record)  # (as a commit thread would, before the start's read lands)
    known.load(store)
    assert [r.version_id for r in known.manifest(store).records] == [record.version_id]


def test_only_the_versions_a_plan_can_choose_are_kept(store):
    """A record names every rank's file: a long run's history is not held, only each layer's
    newest whole versions and the partial ones newer than the oldest of those."""
    known = KnownVersions(kept_per_layer=2)
    known.load(store)
    for step in (1, 2, 3, 4):
        known.committed(store.commit(list(written_receipts(store, "embed", step))))
    (capture, _) = written_receipts(store, "embed", 4)
    known.committed(store.commit([capture], partial=True))
    kept = known.manifest(store).records
    assert [(r.step, r.partial) for r in kept] == [(3, False), (4, False), (4, True)] and known.pruned


def test_a_plan_whose_kept_versions_of_a_layer_are_all_unusable_reads_the_stores_history(store):
    run, service = make(store, Writers())
    run.known = KnownVersions(kept_per_layer=1)
    run.join(0, 2, "a0"), run.join(1, 2, "a1")
    train(service, range(1, 6))
    persist_all(run, store, 3)
    persist_all(run, store, 5)
    (newest,) = [r for r in store.versions() if r.layer == "norm" and r.step == 5]
    store.fs.delete(newest.shards[1].path)  # the only kept version of norm is gone
    resume = run.join(1, 2, "b1")
    assert {layer: r.step for layer, r in resume.records.items()} == {"embed": 5, "block.0": 5, "norm": 3}
