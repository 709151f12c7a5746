"""Writing and committing versions: receipts, the manifest, write errors, concurrent writers."""

import subprocess
import sys
import threading
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from layercheck.orchestrator.store.errors import ManifestError, StoreWriteError
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import ShardReceipt, manifest_table
from layercheck.orchestrator.store.recovery_source import VersionReader
from tests.support.store_helpers import PARAMS, cut_shards, even_cuts, faulty_store, layer_state, write_layer

REPO = Path(__file__).resolve().parents[3]


def _shards(layer="block.0", step=7, world_size=3, seed=0):
    state = layer_state(PARAMS, seed=seed)
    return cut_shards(layer, step, PARAMS, state, even_cuts(48, world_size)), state


def _files(root):
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file())


def test_shards_become_visible_only_at_commit(tmp_path):
    store = LayerStore.open(str(tmp_path))
    shards, _ = _shards()
    receipts = [store.write_shard(s) for s in reversed(shards)]  # any order, any process
    assert store.versions() == ()
    record = store.commit(receipts)
    assert store.versions() == (record,)
    assert [s.rank for s in record.shards] == [0, 1, 2]
    assert record.nbytes == sum(r.nbytes for r in receipts)
    assert not [f for f in _files(tmp_path) if f.endswith(".tmp")]


def test_receipts_travel_as_json(tmp_path):
    store = LayerStore.open(str(tmp_path))
    receipt = store.write_shard(_shards()[0][0])
    assert ShardReceipt.from_json(receipt.to_json()) == receipt


@pytest.mark.parametrize("which", ["missing rank", "duplicate rank", "mixed steps", "empty"])
def test_commit_refuses_an_incomplete_version(tmp_path, which):
    store = LayerStore.open(str(tmp_path))
    shards, _ = _shards()
    receipts = [store.write_shard(s) for s in shards]
    other = store.write_shard(_shards(step=8)[0][2])
    bad = {
        "missing rank": receipts[:2],
        "duplicate rank": receipts + receipts[:1],
        "mixed steps": receipts[:2] + [other],
        "empty": [],
    }[which]
    with pytest.raises(ManifestError, match="missing ranks|mix versions|without shard receipts"):
        store.commit(bad)
    assert store.versions() == ()


def test_commit_refuses_a_file_that_vanished(tmp_path):
    store = LayerStore.open(str(tmp_path))
    receipts = [store.write_shard(s) for s in _shards()[0]]
    (tmp_path / receipts[1].path).unlink()
    with pytest.raises(ManifestError, match=r"rank 1's file .* is missing"):
        store.commit(receipts)
    assert store.versions() == ()


def test_manifest_table_lists_every_version(tmp_path):
    store = LayerStore.open(str(tmp_path))
    for layer in ("embed", "block.0", "lm_head"):
        write_layer(store, layer, 200, base=True)
    write_layer(store, "block.0", 260, world_size=4)
    table = manifest_table(store.manifest())
    assert table.num_rows == 4
    assert table.column("layer").to_pylist() == ["block.0", "embed", "lm_head", "block.0"]
    assert table.column("base").to_pylist() == [True, True, True, False]
    assert [len(f) for f in table.column("files").to_pylist()] == [2, 2, 2, 4]


def test_object_store_mode_writes_in_place(tmp_path):
    """Without atomic rename (S3, GCS) files go straight to their final names."""
    seen = []
    fs = StoreFS(
        fs=pafs.LocalFileSystem(),
        root=str(tmp_path),
        atomic_rename=False,
        hook=lambda event, path: seen.append((event, path)),
    )
    store = LayerStore(fs)
    record, state = write_layer(store, "norm", 5)
    assert all(".tmp" not in path for _, path in seen)
    with VersionReader(store, record) as reader:
        assert reader.read("g", "fp32", 0, 7).equal(state["fp32"]["g"])


@pytest.mark.parametrize("failure", ["read-only", "full-at-shard", "full-at-record"])
def test_write_errors_name_path_and_cause_and_lose_nothing(tmp_path, failure):
    store, handler = faulty_store(str(tmp_path))
    old, old_state = write_layer(store, "block.0", 10)
    before = _files(tmp_path)
    shards, _ = _shards(step=20, world_size=2)
    if failure == "read-only":
        handler.read_only = True
        expected = "Permission denied"
    elif failure == "full-at-shard":
        handler.space_left = 100  # the header fits, the tensors do not
        expected = "No space left on device"
    else:
        receipts = [store.write_shard(s) for s in shards]
        handler.space_left = 10
        expected = "No space left on device"
    with pytest.raises(StoreWriteError, match=expected) as info:
        if failure == "full-at-record":
            store.commit(receipts)
        else:
            store.write_version(shards)
    message = str(info.value)
    assert str(tmp_path) in message and ("manifest/" in message or "layers/block.0/" in message)
    handler.read_only, handler.space_left = False, None
    assert store.versions() == (old,)
    assert not [f for f in _files(tmp_path) if f.endswith(".tmp")]
    if failure != "full-at-record":
        assert _files(tmp_path) == before
    with VersionReader(store, old) as reader:
        assert reader.read("w", "exp_avg", 0, 30).equal(old_state["exp_avg"]["w"])


def test_threads_committing_different_layers_lose_nothing(tmp_path):
    store = LayerStore.open(str(tmp_path), fsync=False)
    errors = []

    def writer(layer):
        try:
            for step in range(1, 9):
                write_layer(store, layer, step)
        except Exception as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(f"block.{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    records = store.versions()
    assert sorted((r.layer, r.step) for r in records) == sorted(
        (f"block.{i}", s) for i in range(4) for s in range(1, 9)
    )


def test_processes_committing_different_layers_lose_nothing(tmp_path):
    steps = ",".join(str(s) for s in range(1, 7))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.store_writer_proc",
                str(tmp_path),
                "--layers",
                layers,
                "--steps",
                steps,
            ],
            cwd=REPO,
        )
        for layers in ("embed,block.0", "block.1,norm")
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    records = LayerStore.open(str(tmp_path)).versions()
    assert sorted((r.layer, r.step) for r in records) == sorted(
        (layer, s) for layer in ("embed", "block.0", "block.1", "norm") for s in range(1, 7)
    )


def test_a_partial_version_commits_some_ranks_and_reads_back_what_they_hold(tmp_path):
    store = LayerStore.open(str(tmp_path))
    shards, state = _shards()
    receipts = [store.write_shard(s, origin="capture") for s in (shards[0], shards[2])]  # rank 1 died
    with pytest.raises(ManifestError, match="missing ranks \\[1\\]"):
        store.commit(receipts)
    record = store.commit(receipts, partial=True)
    assert (record.partial, record.origin, [s.rank for s in record.shards]) == (True, "capture", [0, 2])
    assert "-capture-" in record.shards[0].path and "-partial-" in record.version_id
    (again,) = LayerStore.open(str(tmp_path)).versions()
    assert again == record and again.ref.partial
    assert store.check_version(record, deep=True) == []
    with VersionReader(store, record) as reader:
        cut = shards[0].slices[0]
        got = reader.read(cut.name, "fp32", cut.offset, cut.length)
        assert got.equal(state["fp32"][cut.name][cut.offset : cut.offset + cut.length])
        missing = shards[1].slices[0]
        with pytest.raises(ValueError, match="no stored rank holds"):
            reader.read(missing.name, "fp32", missing.offset, missing.length)


def test_receipts_of_a_capture_and_a_snapshot_never_make_one_version(tmp_path):
    store = LayerStore.open(str(tmp_path))
    shards, _ = _shards(world_size=2)
    receipts = [store.write_shard(shards[0]), store.write_shard(shards[1], origin="capture")]
    with pytest.raises(ManifestError, match="receipts mix versions"):
        store.commit(receipts)
    with pytest.raises(ValueError, match="origin must be one of"):
        store.write_shard(shards[0], origin="bogus")
    with pytest.raises(ValueError, match="memory version is held by the writers, never written"):
        store.write_shard(shards[0], origin="memory")
    held = [store.prepare_shard(shard, origin="memory") for shard in shards]  # what a writer holds
    with pytest.raises(ValueError, match="never written to storage or committed"):
        store.commit([p.receipt for p in held], check_files=False)
