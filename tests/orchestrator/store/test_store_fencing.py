"""Two owners of one store can never both commit: a driver frozen (SIGSTOP) past its lease, taken
over by another run, then woken (SIGCONT), has its late commit fenced out by the epochs' rule —
on a local store and on S3 — and its next commit refused."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from layercheck.orchestrator.cli.main import main as cli
from layercheck.orchestrator.store.epochs import EPOCHS_DIR, EpochFence, epoch_path
from layercheck.orchestrator.store.errors import StoreBusyError
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.lease import StoreLease
from layercheck.orchestrator.store.manifest import record_path
from layercheck.policies.plan import newest_recoverable_step
from tests.support.store_helpers import write_layer

# The first driver: takes the lease (1 s TTL, renewed), commits step 1, and freezes itself with a
# real SIGSTOP right after the fence check of its step-2 commit — the worst moment, one write away
# from a commit record. Woken, it finishes that write and then tries step 3.
_FIRST = """
import os, signal, sys
from layercheck.orchestrator.store.epochs import EpochFence
from layercheck.orchestrator.store.errors import LeaseLostError
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.lease import StoreLease
from tests.support.store_helpers import write_layer

class FreezingFence(EpochFence):
    def check(self):
        super().check()
        print("frozen", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)

fs = StoreFS.open(sys.argv[1], fsync=False)
lease = StoreLease.acquire(fs, run="first", ttl_s=1.0, settle_s=0.2)
lease.on_lost = lambda reason: print("renewal: lost", flush=True)
lease.keep_alive()
store = LayerStore(fs)
store.fence = lease.fence
write_layer(store, "block.0", 1, seed=1)
store.fence = FreezingFence(fs, lease.epoch.epoch)
write_layer(store, "block.0", 2, seed=1)
print("woke and committed step 2", flush=True)
store.fence = lease.fence
try:
    write_layer(store, "block.0", 3, seed=1)
    print("committed step 3", flush=True)
except LeaseLostError as error:
    print(f"refused: {error}", flush=True)
lease.release()
"""


def _frozen_first_driver(uri: str) -> subprocess.Popen:
    first = subprocess.Popen(
        [sys.executable, "-c", _FIRST, uri],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    line = first.stdout.readline()
    assert line.strip() == "frozen", f"the first driver did not reach its freeze: {line!r}"
    deadline = time.monotonic() + 30
    while _state(first.pid) != "T":  # SIGSTOP delivered: every thread of it stopped
        assert time.monotonic() < deadline, "the first driver did not stop"
        time.sleep(0.02)
    return first


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def _take_over_after_expiry(uri: str) -> StoreLease:
    fs = StoreFS.open(uri, fsync=False)
    deadline = time.monotonic() + 30
    while True:  # what --resume in a second shell does once the frozen driver's lease expired
        try:
            return StoreLease.acquire(fs, run="second", settle_s=0.2)
        except StoreBusyError:
            assert time.monotonic() < deadline, "the frozen driver's lease never expired"
            time.sleep(0.2)


def _check_one_owner(uri: str, capsys) -> None:
    first = _frozen_first_driver(uri)
    try:
        second = _take_over_after_expiry(uri)
        store = LayerStore(StoreFS.open(uri, fsync=False))
        store.fence = second.fence
        ours, _ = write_layer(store, "block.0", 2, seed=2)
    finally:
        first.send_signal(signal.SIGCONT)
    out, _ = first.communicate(timeout=60)
    assert "woke and committed step 2" in out and "committed step 3" not in out
    assert "refused: this run no longer holds" in out and "run 'second'" in out, out

    manifest = store.manifest()
    steps = {(r.step, r.epoch) for r in manifest.records}
    assert steps == {(1, 1), (2, 2)}, f"only the first run's step 1 and the second's step 2 count: {steps}"
    (late, why), *others = manifest.fenced
    assert not others and (late.step, late.epoch) == (2, 1) and "after epoch 2 (run 'second'" in why
    assert store.fs.info(record_path(late.version_id)).size, "the late record is in the store: the rule ignores it"
    assert newest_recoverable_step(["block.0"], manifest.refs()) == 2
    assert {r.version_id for r in manifest.records if r.step == 2} == {ours.version_id}

    capsys.readouterr()
    assert cli(["verify", uri]) == 0
    said = capsys.readouterr().out
    assert f"FENCED version {late.version_id}" in said and "1 fenced-out version(s) ignored" in said
    assert cli(["gc", uri, "--grace", "0"]) == 0
    assert f"deleted version {late.version_id} (fenced out" in capsys.readouterr().out
    assert not store.manifest().fenced and all(store.fs.info(s.path).size is None for s in late.shards)
    second.release()


def test_a_driver_frozen_past_its_lease_cannot_commit_beside_the_new_owner_local(tmp_path, capsys):
    _check_one_owner(str(tmp_path / "run"), capsys)


def test_a_driver_frozen_past_its_lease_cannot_commit_beside_the_new_owner_s3(s3, capsys):
    _check_one_owner(s3.uri("runs/fenced"), capsys)


def test_epochs_count_up_and_each_seals_what_was_committed_before_it(tmp_path):
    fs = StoreFS.open(str(tmp_path / "run"), fsync=False)
    store = LayerStore(fs)
    write_layer(store, "embed", 0, base=True)  # a store written before epochs: epoch 0
    first = StoreLease.acquire(fs, run="a", settle_s=0)
    first.release()
    second = StoreLease.acquire(fs, run="b", settle_s=0)
    second.release()
    assert (first.epoch.epoch, second.epoch.epoch) == (1, 2)
    sealed = json.loads(fs.read_bytes(epoch_path(2)))["sealed"]
    assert sealed == [r.version_id for r in store.versions()] and len(sealed) == 1
    assert [rel for rel, _ in fs.list_files(EPOCHS_DIR)] == [epoch_path(1), epoch_path(2)]


def test_a_record_claiming_an_epoch_never_opened_is_damaged_not_believed(tmp_path):
    fs = StoreFS.open(str(tmp_path / "run"), fsync=False)
    lease = StoreLease.acquire(fs, run="a", settle_s=0)
    store = LayerStore(fs)
    store.fence = lease.fence
    record, _ = write_layer(store, "embed", 4)
    forged = {**record.to_json(), "epoch": 7}
    fs.write_bytes(record_path(record.version_id), json.dumps(forged).encode())
    manifest = store.manifest()
    assert manifest.records == () and "claims epoch 7" in manifest.problems[0]
    assert set(manifest.claimed) == {s.path for s in record.shards}, "its files are not orphans either"
    lease.release()


def test_the_fence_names_the_run_that_took_the_store(tmp_path):
    from layercheck.orchestrator.store.errors import LeaseLostError

    fs = StoreFS.open(str(tmp_path / "run"), fsync=False)
    StoreLease.acquire(fs, run="a", settle_s=0)
    StoreLease.acquire(fs, run="b", take_over=True, settle_s=0)
    with pytest.raises(LeaseLostError, match=r"epoch 1, and another run, epoch 2 \(run 'b'"):
        EpochFence(fs, 1).check()


def test_a_record_claiming_a_step_past_its_runs_steps_is_damaged_never_the_newest_step(tmp_path):
    """A record made to claim step 400 with every name agreeing (version id, file names) in a run
    of 40 steps: no run of its epoch trained so far, so it is damaged, not the newest step."""
    fs = StoreFS.open(str(tmp_path / "run"), fsync=False)
    lease = StoreLease.acquire(fs, run="a", settle_s=0, steps=40)
    store = LayerStore(fs)
    store.fence = lease.fence
    record, _ = write_layer(store, "embed", 40)
    forged = json.loads(json.dumps(record.to_json()).replace("0000000040", "0000000400"))
    forged["step"] = 400
    for shard in record.shards:
        fs.write_bytes(shard.path.replace("0000000040", "0000000400"), fs.read_bytes(shard.path))
    fs.write_bytes(record_path(forged["version_id"]), json.dumps(forged).encode())
    manifest = store.manifest()
    assert [r.step for r in manifest.records] == [40]
    assert any("claims step 400, but the run of its epoch 1 trains 40 steps" in p for p in manifest.problems)
    assert newest_recoverable_step(["embed"], manifest.refs()) == 40
    lease.release()


def test_only_the_epoch_files_the_records_need_are_read_and_a_damaged_one_fences_nothing_out(tmp_path):
    """A store resumed many times holds an epoch file per start, each sealing every version id of
    its time: a manifest read reads only the epochs its records belong to and the one after each.
    And a damaged epoch file is reported, but never makes the records of its epoch damaged."""
    fs = StoreFS.open(str(tmp_path / "run"), fsync=False)
    for run in ("a", "b", "c"):
        StoreLease.acquire(fs, run=run, settle_s=0).release()  # epochs 1-3, no records in them
    lease = StoreLease.acquire(fs, run="d", settle_s=0)  # epoch 4
    store = LayerStore(fs)
    store.fence = lease.fence
    record, _ = write_layer(store, "embed", 2)
    fs.write_bytes(epoch_path(2), b"not json")  # an old epoch no record needs: not even read
    manifest = store.manifest()
    assert [r.version_id for r in manifest.records] == [record.version_id] and manifest.problems == ()
    fs.write_bytes(epoch_path(4), b"not json")  # the newest, its records' own: read, reported
    manifest = store.manifest()
    assert [r.version_id for r in manifest.records] == [record.version_id]
    assert any("unreadable epoch file" in p for p in manifest.problems)
    lease.release()
