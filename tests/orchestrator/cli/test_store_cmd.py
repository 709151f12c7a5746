"""``layercheck inspect | verify | gc`` on a real store."""

import json
from pathlib import Path

import pytest

from layercheck.orchestrator.cli.main import main
from layercheck.orchestrator.store.layer_store import LayerStore
from tests.support.store_helpers import write_layer


@pytest.fixture
def run(tmp_path):
    store = LayerStore.open(str(tmp_path))
    for layer in ("embed", "block.0", "norm"):
        write_layer(store, layer, 100, base=True)
    for layer, step in (("block.0", 150), ("block.0", 200), ("norm", 180)):
        write_layer(store, layer, step)
    return store


def test_inspect_table(run, capsys):
    assert main(["inspect", run.uri]) == 0
    out = capsys.readouterr().out
    assert "newest recoverable step 200" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:]}
    assert rows["block.0"][1:2] == ["200"] and rows["norm"][1:2] == ["180"] and rows["embed"][1:3] == ["100", "yes"]
    assert list(rows)[:3] == ["embed", "block.0", "norm"]  # model order
    assert rows["total/max"][1:3] == ["100", "6"]  # max staleness, versions


def test_inspect_json(run, capsys):
    assert main(["inspect", f"file://{run.uri}", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    layers = {row["layer"]: row for row in data["layers"]}
    assert data["newest_recoverable_step"] == 200 and data["base_steps"] == [100]
    assert (layers["norm"]["staleness"], layers["block.0"]["versions"]) == (20, 3)
    assert data["totals"]["versions"] == 6 and data["totals"]["bytes"] == sum(r.nbytes for r in run.versions())


def test_verify_ok_then_names_the_damage(run, capsys):
    assert main(["verify", run.uri]) == 0
    assert "OK" in capsys.readouterr().out
    victim = [r for r in run.versions() if r.layer == "norm" and r.step == 180][0]
    path = Path(run.fs.path(victim.shards[0].path))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    Path(run.fs.path(victim.shards[1].path)).unlink()
    assert main(["verify", run.uri]) == 1
    out = capsys.readouterr().out
    assert victim.shards[0].path in out and "fails its checksum" in out
    assert f"{victim.shards[1].path}: missing" in out and "2 problem(s)" in out


def test_gc_dry_run_then_for_real(run, capsys):
    assert main(["gc", run.uri, "--dry-run"]) == 0
    out = capsys.readouterr().out  # embed has nothing newer than the base: the base stays
    assert out.count("would delete version") == 1 and "would free" in out
    write_layer(run, "embed", 190)
    assert main(["gc", run.uri, "--dry-run"]) == 0
    assert capsys.readouterr().out.count("would delete version") == 4
    assert len(run.versions()) == 7
    assert main(["gc", run.uri, "--window", "0"]) == 0
    assert "freed" in capsys.readouterr().out
    assert {(r.layer, r.step) for r in run.versions()} == {("block.0", 200), ("norm", 180), ("embed", 190)}
    assert main(["verify", run.uri]) == 0


def test_gc_rejects_a_bad_window(run, capsys):
    assert main(["gc", run.uri, "--window", "-3"]) == 2
    assert "window must be" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["inspect", "verify", "gc"])
def test_a_missing_run_is_an_error_not_an_empty_store(tmp_path, capsys, command):
    assert main([command, str(tmp_path / "no-such-run")]) == 2
    assert "no store at" in capsys.readouterr().out


def test_inspect_shows_a_capture_newer_than_the_whole_version(run, capsys):
    from tests.support.store_helpers import PARAMS, cut_shards, even_cuts, layer_state

    shard = cut_shards("norm", 205, PARAMS, layer_state(PARAMS, seed=3), even_cuts(42, 2))[0]
    capture = run.commit([run.write_shard(shard, origin="capture")], partial=True)
    assert main(["inspect", run.uri]) == 0
    out = capsys.readouterr().out
    assert "newest recoverable step 205" in out  # a failure's capture counts; the whole versions stay the bases
    norm = next(line for line in out.splitlines() if line.startswith("norm "))
    assert norm.split()[1] == "180" and "205 capture (ranks 0)" in norm
    assert main(["inspect", run.uri, "--json"]) == 0
    layers = {row["layer"]: row for row in json.loads(capsys.readouterr().out)["layers"]}
    assert layers["norm"]["partial"] == [
        {"version_id": capture.version_id, "step": 205, "origin": "capture", "ranks": [0]}
    ]
    assert layers["norm"]["staleness"] == 25 and layers["embed"]["partial"] == []  # of the whole versions


def test_inspect_into_a_pipe_that_closes_early_is_no_error(run, monkeypatch):
    """``layercheck inspect RUN | head -1``: the reader has left when the table is written."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)  # what `head -1` does once it has its line
    stdout = os.fdopen(write_end, "w", buffering=1)
    monkeypatch.setattr("sys.stdout", stdout)
    assert main(["inspect", run.uri]) == 0
    stdout.close()


@pytest.mark.parametrize(
    "where",
    ["length-prefix", "header", "first-data-byte", "middle-data-byte", "last-data-byte", "truncated"],
)
def test_verify_names_a_single_flipped_bit_anywhere_in_a_shard(run, capsys, where):
    """One bit flipped (or the file cut short by a byte) anywhere in a committed shard: in the
    header's length prefix, the JSON header, or any byte of the tensor data. ``verify`` reads every
    byte (the record's size and header checksum, each tensor's checksum): it exits 1 naming the
    file, and every other version stays OK."""
    victim = [r for r in run.versions() if r.layer == "norm" and r.step == 180][0]
    path = Path(run.fs.path(victim.shards[0].path))
    data = bytearray(path.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    at = {
        "length-prefix": 0,
        "header": header_end // 2,
        "first-data-byte": header_end,
        "middle-data-byte": (header_end + len(data)) // 2,
        "last-data-byte": len(data) - 1,
    }
    if where == "truncated":
        del data[-1]
    else:
        data[at[where]] ^= 0x10
    path.write_bytes(bytes(data))
    assert main(["verify", run.uri]) == 1
    out = capsys.readouterr().out
    assert f"BAD version {victim.version_id}" in out and victim.shards[0].path in out, out
    assert "1 problem(s)" in out, out  # the only one: every other version checks
