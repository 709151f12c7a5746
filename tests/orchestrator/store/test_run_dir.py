"""--overwrite deletes only what LayerCheck wrote, and never at a suspicious location."""

import os

import pytest

from layercheck.orchestrator.store.errors import UnsafeStoreError
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.run_dir import check_run_location, clear_run, location_problem, run_dir_contents
from tests.support.store_helpers import write_layer


def _run(root):
    store = LayerStore.open(str(root), fsync=False)
    write_layer(store, "embed", 20, base=True)
    write_layer(store, "block.0", 20, base=True)
    write_layer(store, "block.0", 30)
    store.fs.write_bytes("run.json", b"{}")
    store.fs.write_bytes("drift_trace.json", b"{}")
    (root / "layers" / "block.0" / "0000000040-rank00000of00002-0a0b0c0d.safetensors.1a2b3c4d.tmp").write_bytes(b"x")
    return store


def test_overwrite_deletes_every_file_layercheck_wrote_and_keeps_the_lease(tmp_path):
    store = _run(tmp_path / "run")
    store.fs.write_bytes("owner.json", b"{}")
    deleted = clear_run(store.fs, keep=frozenset({"owner.json"}))
    assert deleted == 3 * 2 + 3 + 2 + 1  # shard files, commit records, run files, a temporary
    assert sorted(os.listdir(tmp_path / "run")) == ["owner.json"]


def test_overwrite_refuses_a_directory_with_foreign_files_and_deletes_nothing(tmp_path):
    store = _run(tmp_path / "run")
    (tmp_path / "run" / "notes.txt").write_text("my notes")
    (tmp_path / "run" / "layers" / "block.0" / "README").write_text("not a shard")
    (tmp_path / "run" / "src").mkdir()
    before = sorted(p for p in (tmp_path / "run").rglob("*"))
    with pytest.raises(UnsafeStoreError, match="did not write") as error:
        clear_run(store.fs)
    assert (
        "notes.txt" in str(error.value) and "layers/block.0/README" in str(error.value) and "src/" in str(error.value)
    )
    assert sorted(p for p in (tmp_path / "run").rglob("*")) == before
    assert len(store.versions()) == 3


def test_contents_sort_owned_from_foreign(tmp_path):
    store = _run(tmp_path / "run")
    (tmp_path / "run" / "manifest" / "block.0@0000000030-c0ffee01.json.bak").write_text("{}")
    contents = run_dir_contents(store.fs)
    assert contents.foreign == ("manifest/block.0@0000000030-c0ffee01.json.bak",)
    assert "run.json" in contents.owned and len([p for p in contents.owned if p.startswith("manifest/")]) == 3


@pytest.mark.parametrize("where", ["cwd", "home", "root", "parent_of_cwd"])
def test_suspicious_locations_are_refused(tmp_path, monkeypatch, where):
    cwd, home = tmp_path / "project" / "src", tmp_path / "home"
    cwd.mkdir(parents=True)
    home.mkdir()
    path = {"cwd": cwd, "home": home, "root": "/", "parent_of_cwd": tmp_path / "project"}[where]
    with pytest.raises(UnsafeStoreError, match="own"):
        check_run_location(StoreFS.open(str(path)), cwd=str(cwd), home=str(home))
    check_run_location(StoreFS.open(str(cwd / "runs" / "x")), cwd=str(cwd), home=str(home))


def test_empty_storage_is_the_working_directory_and_clear_run_refuses_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "main.py").write_text("print('my source')")
    store = _run(tmp_path)  # a run written into the source tree, as storage = "" would
    with pytest.raises(UnsafeStoreError, match="working directory"):
        clear_run(StoreFS.open(""))
    assert (tmp_path / "main.py").exists() and len(store.versions()) == 3


def test_a_bucket_root_is_refused_but_a_prefix_is_fine():
    assert "bucket root" in location_problem("s3", "bucket", uri="s3://bucket", cwd="/x", home="/y")
    assert location_problem("s3", "bucket/runs/a", uri="s3://bucket/runs/a", cwd="/x", home="/y") == ""


def test_overwrite_clears_a_recovered_run_and_keeps_its_epochs(tmp_path):
    """A store a recovery wrote into holds survivors' capture shards and partial records, and every
    run's epoch: --overwrite takes the first two for its own and keeps the epochs (a new owner's
    epoch must stay newer than any earlier owner's)."""
    from layercheck.orchestrator.store.lease import StoreLease

    store = _run(tmp_path / "run")
    lease = StoreLease.acquire(store.fs, run="first", settle_s=0)
    (tmp_path / "run" / "layers" / "block.0" / "0000000040-capture-rank00001of00002-0a0b0c0d.safetensors").write_bytes(
        b"x"
    )
    (tmp_path / "run" / "manifest" / "block.0@0000000040-partial-0a0b0c0d.json").write_text("{}")
    assert run_dir_contents(store.fs).foreign == ()
    clear_run(store.fs, keep=frozenset({"owner.json"}))
    assert sorted(os.listdir(tmp_path / "run")) == ["epochs", "owner.json"]
    assert os.listdir(tmp_path / "run" / "epochs") == [f"{lease.epoch.epoch:010d}.json"]
