"""The run's initial state as every layer's version at step 0 (``initial.json``), with real
DeepSpeed (ZeRO-3, 2 ranks, gloo on CPU): a recovery before some layers were ever saved takes
them from the freshly built engine — bit for bit its initial weights and zero moments — while a
survivor's capture overlaid on them still gives its slices their captured values; the plan
counts their staleness from step 0. Also the record itself: written by a fresh ``layercheck
train`` start, kept by ``--resume``, damaged ones refused by name."""

import json

import pytest

from layercheck.orchestrator.store.errors import ManifestError
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.initial_state import INITIAL_FILE, read_initial, record_initial
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import VersionRecord
from layercheck.orchestrator.store.recovery_source import resolve_plan
from layercheck.policies.plan import NoUsableVersionError
from tests.support import overlay_jobs as jobs
from tests.support.dist_harness import run_jobs


@pytest.mark.slow
def test_never_saved_layers_come_from_the_rebuilt_engine_under_the_survivors_capture(tmp_path):
    (results,) = run_jobs(2, [(jobs.initial_overlay_job, (str(tmp_path / "store"),))])
    saver = results[0]
    assert saver["mismatches"] == [], "weights or moments differ from initial/S/T as the plan says"
    assert saver["moved_from_initial"] > 0, "training must move the weights, or the check means nothing"
    last = list(saver["versions"])[-1]
    for layer, version_id in saver["versions"].items():
        origins = [(s["origin"], s["step"]) for s in saver["sources"][layer]]
        if layer in jobs.SAVED_AT_S:
            assert origins == [("capture", jobs.T), ("policy", jobs.S)], (layer, origins)
        elif layer == last:  # never saved, never captured: the rebuilt state alone
            assert version_id == f"{layer}@initial" and origins == [("initial", 0)], (layer, origins)
        else:
            assert version_id == f"{layer}@initial" and origins == [("capture", jobs.T), ("initial", 0)]
    assert saver["max_staleness"] == jobs.T  # the initial state is step 0's
    for r in results:  # a layer from the initial state keeps Adam's count at 0 (its moments are zero)
        assert r["adam_steps"][last] == 0


def test_without_the_record_a_never_saved_layer_is_a_hole(tmp_path):
    store = LayerStore.open(str(tmp_path), fsync=False)
    with pytest.raises(NoUsableVersionError, match="no usable version for embed"):
        resolve_plan(store, {"embed": 4, "norm": 2}, 3)
    record_initial(store.fs, ["embed", "norm"])
    resolved = resolve_plan(store, {"embed": 4, "norm": 2}, 3)
    assert {layer: r.version_id for layer, r in resolved.records.items()} == {
        "embed": "embed@initial",
        "norm": "norm@initial",
    }
    assert resolved.plan.max_staleness == 3


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b'{"format": "layercheck.initial/9", "source": "rebuild", "layers": []}',
        b'{"format": "layercheck.initial/1", "source": "rebuild", "layers": ["../x"]}',
    ],
    ids=["not-json", "other-format", "bad-layer-name"],
)
def test_a_damaged_record_is_named_and_planning_goes_on_without_it(tmp_path, content, caplog):
    fs = StoreFS.open(str(tmp_path))
    fs.write_bytes(INITIAL_FILE, content)
    with pytest.raises(ManifestError, match=INITIAL_FILE):
        read_initial(fs)
    with pytest.raises(NoUsableVersionError):
        resolve_plan(LayerStore(fs), {"embed": 4}, 3)
    assert any(INITIAL_FILE in message for message in caplog.messages)


def test_a_commit_record_cannot_pose_as_the_initial_state(tmp_path):
    data = {
        "format": "layercheck.version/1",
        "version_id": "embed@initial",
        "layer": "embed",
        "step": 0,
        "world_size": 0,
        "base": True,
        "committed_at": 0.0,
        "shards": [],
        "origin": "initial",
    }
    with pytest.raises(ManifestError, match="initial-state placeholder"):
        VersionRecord.from_json(data, source="manifest/embed@initial.json")
    assert json.loads(json.dumps(data))  # (the record itself is well-formed JSON)
