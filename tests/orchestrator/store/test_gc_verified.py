"""GC never deletes the newest verified fallback of a layer: when a layer's
newest version is damaged, the version a recovery falls back to is kept, and the store stays
recoverable."""

import pytest

from layercheck.orchestrator.cli.main import main
from layercheck.orchestrator.store.gc import GcConfig, collect_garbage
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.recovery_source import resolve_plan
from layercheck.policies.plan import VersionRef
from layercheck.policies.retention import RetentionConfig, plan_retention
from tests.support.store_helpers import write_layer


def _history(store):
    records = {}
    for layer, step, base in [("A", 20, True), ("B", 20, True), ("A", 30, False), ("A", 40, False), ("B", 40, False)]:
        records[f"{layer}@{step}"], _ = write_layer(store, layer, step, base=base)
    return records


def _flip_last_byte(store, record):
    path = store.fs.path(record.shards[1].path)
    with open(path, "r+b") as file:
        file.seek(-1, 2)
        last = file.read(1)
        file.seek(-1, 2)
        file.write(bytes([last[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_damaged_newest_version_keeps_its_fallback(tmp_path, damage):
    store = LayerStore.open(str(tmp_path / "run"), fsync=False)
    records = _history(store)
    if damage == "corrupt":
        _flip_last_byte(store, records["A@40"])
    else:
        store.fs.delete(records["A@40"].shards[0].path)
    report = collect_garbage(store, GcConfig(grace_s=0))
    remaining = {f"{r.layer}@{r.step}" for r in store.versions()}
    assert remaining == {"A@30", "A@40", "B@40"}  # A@30: the fallback; A@40: damaged, kept as evidence
    assert list(report.damaged) == [records["A@40"].version_id]
    resolved = resolve_plan(store, {"A": 1, "B": 1}, deep=True)
    assert resolved.records["A"].step == 30 and resolved.records["B"].step == 40


def test_undamaged_history_is_pruned_as_before(tmp_path):
    store = LayerStore.open(str(tmp_path / "run"), fsync=False)
    _history(store)
    report = collect_garbage(store, GcConfig(grace_s=0))
    assert {f"{r.layer}@{r.step}" for r in store.versions()} == {"A@40", "B@40"} and not report.damaged


def test_every_version_of_a_layer_damaged_keeps_everything():
    refs = [
        VersionRef(step=s, layer=layer, version_id=f"{layer}@{s}", base=s == 20)
        for layer, s in [("A", 20), ("A", 30), ("B", 20), ("B", 40)]
    ]
    decision = plan_retention(refs, config=RetentionConfig(), unusable={"A@20": "x", "A@30": "y"})
    assert decision.newest_step is None and not decision.delete


def test_gc_command_names_the_damaged_version(tmp_path, capsys):
    store = LayerStore.open(str(tmp_path / "run"), fsync=False)
    records = _history(store)
    _flip_last_byte(store, records["A@40"])
    assert main(["gc", str(tmp_path / "run"), "--grace", "0"]) == 0
    out = capsys.readouterr().out
    assert f"damaged version {records['A@40'].version_id} kept" in out and "layercheck verify" in out
