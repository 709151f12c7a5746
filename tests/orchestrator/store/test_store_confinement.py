"""The store never reaches outside itself: a path from a commit record (which a damaged or
hostile store controls) that is absolute, climbs with ``..`` or passes through a symbolic link
leaving the root is never read, written or deleted; ``verify`` reports the record, ``gc`` keeps
the files of a record it cannot read and reports them."""

import json
import os

import pytest

from layercheck.orchestrator.cli.main import main
from layercheck.orchestrator.store.errors import PathOutsideStoreError
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.gc import GcConfig, collect_garbage
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import record_path
from tests.support.store_helpers import write_layer


def _rewrite_record(store, record, change):
    path = store.fs.path(record_path(record.version_id))
    with open(path) as f:
        data = json.load(f)
    change(data)
    with open(path, "w") as f:
        json.dump(data, f)


def _history(tmp_path):
    """A store whose layer A has versions at 20 (base), 30 and 40: GC's default window deletes 30."""
    store = LayerStore.open(str(tmp_path / "run"), fsync=False)
    records = {step: write_layer(store, "A", step, base=step == 20)[0] for step in (20, 30, 40)}
    return store, records


@pytest.mark.parametrize("rel", ["/etc/passwd", "../x", "layers/../../x", "layers/A/../../../x", "a\\..\\b"])
def test_a_path_leaving_the_root_is_refused_by_name(tmp_path, rel):
    fs = StoreFS.open(str(tmp_path / "run"))
    with pytest.raises(PathOutsideStoreError):
        fs.path(rel)


def test_a_symlink_out_of_the_root_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("keep me")
    fs = StoreFS.open(str(tmp_path / "run"))
    (tmp_path / "run" / "layers").mkdir(parents=True)
    os.symlink(outside, tmp_path / "run" / "layers" / "A")
    with pytest.raises(PathOutsideStoreError, match="outside the store"):
        fs.path("layers/A/victim.txt")
    with pytest.raises(PathOutsideStoreError):
        fs.delete("layers/A/victim.txt")
    assert (outside / "victim.txt").read_text() == "keep me"
    assert fs.path("layers/B/file") == f"{fs.root}/layers/B/file"  # inside: allowed


@pytest.mark.parametrize("bad", ["layers/A/../../../victim.txt", "/VICTIM", "manifest/x.json"])
def test_gc_and_verify_never_touch_a_path_a_record_points_outside(tmp_path, capsys, bad):
    store, records = _history(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    bad = bad.replace("/VICTIM", str(victim))
    _rewrite_record(store, records[30], lambda d: d["shards"][0].update(path=bad))

    assert main(["verify", str(tmp_path / "run")]) == 1
    out = capsys.readouterr().out
    assert "BAD" in out and records[30].version_id in out
    assert main(["gc", str(tmp_path / "run"), "--grace", "0"]) == 0
    out = capsys.readouterr().out
    assert victim.read_text() == "keep me"
    # the record is damaged, so its other shard is kept as a file it names, never taken for an orphan
    assert os.path.exists(store.fs.path(records[30].shards[1].path))
    assert "kept 1 uncommitted file" in out


def test_a_record_of_a_newer_format_keeps_its_files(tmp_path):
    store, records = _history(tmp_path)
    _rewrite_record(store, records[30], lambda d: d.update(format="a-newer-format"))
    report = collect_garbage(store, GcConfig(grace_s=0))
    assert set(report.kept_files) == {s.path for s in records[30].shards}
    assert not report.orphans
    assert all(os.path.exists(store.fs.path(s.path)) for s in records[30].shards)


def test_a_record_that_is_not_json_keeps_every_uncommitted_file(tmp_path):
    store, records = _history(tmp_path)
    with open(store.fs.path(record_path(records[30].version_id)), "w") as f:
        f.write('{"format": 1, "shards": [')  # torn
    stray = store.fs.path("layers/A/0000000050-rank00000of00002-0a0b0c0d.safetensors")  # LayerCheck's naming
    with open(stray, "wb") as f:
        f.write(b"x")
    report = collect_garbage(store, GcConfig(grace_s=0))
    assert "layers/A/0000000050-rank00000of00002-0a0b0c0d.safetensors" in report.kept_files and not report.orphans
    assert os.path.exists(stray)
    assert all(os.path.exists(store.fs.path(s.path)) for s in records[30].shards)


def test_a_symlinked_layer_directory_is_damaged_and_gc_deletes_nothing_outside(tmp_path, capsys):
    store, records = _history(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    layer_dir = os.path.dirname(store.fs.path(records[30].shards[0].path))
    for name in os.listdir(layer_dir):
        os.replace(os.path.join(layer_dir, name), outside / name)
    os.rmdir(layer_dir)
    os.symlink(outside, layer_dir)
    before = sorted(os.listdir(outside))

    assert main(["verify", str(tmp_path / "run")]) == 1
    assert "outside the store" in capsys.readouterr().out
    report = collect_garbage(store, GcConfig(grace_s=0))
    assert sorted(os.listdir(outside)) == before  # nothing outside was deleted
    assert all("outside the store" in why for why in report.damaged.values()) and report.damaged
    assert not report.deleted_versions


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(step=400),  # a step-40 record claiming step 400
        lambda d: d.update(layer="B"),
        lambda d: d.update(base=True),
        lambda d: d["shards"][1].update(rank=0),
    ],
    ids=["future-step", "other-layer", "base-flag", "rank"],
)
def test_a_record_that_disagrees_with_its_names_is_damaged_never_believed(tmp_path, capsys, edit):
    store, records = _history(tmp_path)
    _rewrite_record(store, records[40], edit)
    manifest = store.manifest()
    assert records[40].version_id not in manifest.by_id() and len(manifest.problems) == 1
    assert main(["inspect", str(tmp_path / "run")]) == 0
    assert "newest recoverable step 30" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "run")]) == 1
    assert f"BAD {store.fs.uri(record_path(records[40].version_id))}" in capsys.readouterr().out
