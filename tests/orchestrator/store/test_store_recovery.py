"""Recovery from the store: exact-range reads at any world size, and falling back past an
unusable (corrupt, truncated, deleted) version to the previous one or the base."""

import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layercheck.orchestrator.store.errors import CorruptShardError
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.recovery_source import VersionReader, resolve_plan
from layercheck.policies.plan import NoUsableVersionError
from layercheck.workers.shard import STATE_KEYS, LayerShard
from tests.support.store_helpers import PARAMS, cut_shards, layer_state, relabel_version, write_layer

LAYERS = {"embed": 48, "block.0": 48, "norm": 48}


def _cuts(draw, total):
    world_size = draw(st.integers(1, 6))
    inner = sorted(draw(st.lists(st.integers(0, total), min_size=world_size - 1, max_size=world_size - 1)))
    return [0, *inner, total]


@st.composite
def resharding(draw):
    n = draw(st.integers(1, 4))
    params = {f"p{i}": tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))) for i in range(n)}
    total = sum(math.prod(s) for s in params.values())
    return params, _cuts(draw, total), _cuts(draw, total)


@settings(max_examples=40, deadline=None)
@given(resharding())
def test_any_world_size_reads_back_exactly_at_any_other(case):
    params, written_cuts, read_cuts = case
    state = layer_state(params, seed=len(written_cuts))
    with tempfile.TemporaryDirectory() as root:
        store = LayerStore.open(root, fsync=False)
        record = store.write_version(cut_shards("block.3", 9, params, state, written_cuts))
        targets = cut_shards("block.3", 9, params, state, read_cuts)
        with VersionReader(store, record) as reader:
            assert reader.optimizer_step == 9 and reader.param_shapes == params
            for target in targets:
                for key in STATE_KEYS:
                    got = (
                        torch.cat([reader.read_slice(s, key) for s in target.slices])
                        if target.slices
                        else torch.zeros(0)
                    )
                    assert torch.equal(got, target.tensors[key])


def test_overlapping_stored_shards_are_fine(tmp_path):
    """ZeRO-0: every rank holds the whole layer."""
    state = layer_state(PARAMS, seed=5)
    full = cut_shards("norm", 3, PARAMS, state, [0, 48])[0]
    shards = [
        LayerShard(
            layer="norm", step=3, rank=r, world_size=2, slices=full.slices, tensors=full.tensors, optimizer_step=3
        )
        for r in range(2)
    ]
    store = LayerStore.open(str(tmp_path))
    with VersionReader(store, store.write_version(shards)) as reader:
        assert reader.read("w", "fp32", 4, 20).equal(state["fp32"]["w"][4:24])


def test_reading_outside_what_was_stored_is_named(tmp_path):
    store = LayerStore.open(str(tmp_path))
    record, _ = write_layer(store, "norm", 3)
    with VersionReader(store, record) as reader:
        with pytest.raises(KeyError, match="no parameter 'nope'"):
            reader.read("nope", "fp32", 0, 1)
        with pytest.raises(ValueError, match=r"elements \[5, 9\)"):
            reader.read("b", "fp32", 2, 7)


@pytest.fixture
def history(tmp_path):
    """A base at 100 for every layer; block.0 again at 150 and 200, norm at 180."""
    store = LayerStore.open(str(tmp_path))
    written = {}
    for layer in LAYERS:
        written[(layer, 100)] = write_layer(store, layer, 100, base=True)
    for layer, step in (("block.0", 150), ("block.0", 200), ("norm", 180)):
        written[(layer, step)] = write_layer(store, layer, step)
    return store, written


def _damage(store, record, how, rank=1):
    path = Path(store.fs.path(record.shards[rank].path))
    data = bytearray(path.read_bytes())
    if how == "flip-data":
        data[-3] ^= 0x55
    elif how == "flip-header":
        data[20] ^= 0x01
    elif how == "truncate":
        data = data[:-8]
    elif how == "delete":
        path.unlink()
        return
    path.write_bytes(bytes(data))


def _assert_loads(store, record, state):
    with VersionReader(store, record) as reader:
        for key in STATE_KEYS:
            for name, shape in PARAMS.items():
                assert reader.read(name, key, 0, math.prod(shape)).equal(state[key][name])


def test_plan_uses_the_newest_versions(history):
    store, written = history
    resolved = resolve_plan(store, LAYERS)
    assert resolved.plan.t_fail == 200 and not resolved.skipped
    assert {layer: r.step for layer, r in resolved.records.items()} == {"embed": 100, "block.0": 200, "norm": 180}
    _assert_loads(store, resolved.records["block.0"], written[("block.0", 200)][1])


@pytest.mark.parametrize("how", ["flip-data", "flip-header", "truncate", "delete"])
def test_unusable_version_falls_back_to_the_previous_one(history, how, caplog):
    store, written = history
    bad = written[("block.0", 200)][0]
    _damage(store, bad, how)
    resolved = resolve_plan(store, LAYERS)
    assert resolved.records["block.0"].step == 150
    # the rejected version was the only one at 200: the newest step the others reach is norm's 180
    assert resolved.plan.t_fail == 180 and resolved.plan.max_staleness == 80
    assert bad.shards[1].path in resolved.skipped[bad.version_id]
    assert f"version {bad.version_id} of layer block.0 is unusable" in caplog.text
    _assert_loads(store, resolved.records["block.0"], written[("block.0", 150)][1])


def test_shallow_check_leaves_data_errors_to_the_reader_which_names_the_version(history):
    store, written = history
    bad = written[("block.0", 200)][0]
    _damage(store, bad, "flip-data")
    resolved = resolve_plan(store, LAYERS, deep=False)
    assert resolved.records["block.0"] == bad
    with pytest.raises(CorruptShardError) as info, VersionReader(store, bad) as reader:
        for key in STATE_KEYS:
            for name, shape in PARAMS.items():
                reader.read(name, key, 0, math.prod(shape))
    assert info.value.version_id == bad.version_id and "fails its checksum" in str(info.value)
    again = resolve_plan(store, LAYERS, deep=False, skip={bad.version_id: str(info.value)})
    assert again.records["block.0"].step == 150


@pytest.mark.parametrize("deep", [False, True], ids=["headers", "every-byte"])
def test_the_default_step_comes_only_from_versions_the_plan_accepts(history, deep, caplog):
    """A run stopped after step 200; embed's version of step 210 renamed consistently to step 500
    (record, version id, file names) while its files' headers still say 210. The plan rejects it:
    the step a resume continues after must not be 500 either (300 steps of data order and
    learning-rate schedule skipped), but the newest step of the versions left."""
    store, _ = history
    renamed = relabel_version(store, write_layer(store, "embed", 210)[0], 500)
    resolved = resolve_plan(store, LAYERS, deep=deep)
    assert "holds (layer, step, rank, world) ('embed', 210" in resolved.skipped[renamed.version_id]
    assert resolved.plan.t_fail == 200 and resolved.records["embed"].step == 100
    assert resolved.plan.max_staleness == 100  # staleness counted from 200, not 500
    assert f"version {renamed.version_id} of layer embed is unusable" in caplog.text


def test_the_default_step_is_recomputed_until_every_version_left_is_usable(history):
    """After each rejection the default step is recomputed from what is left: block.0's versions
    of 200 and 150 both fail in turn, so the run's newest usable step is norm's 180."""
    store, written = history
    renamed = relabel_version(store, write_layer(store, "embed", 210)[0], 500)
    for step in (200, 150):
        store.fs.delete(written[("block.0", step)][0].shards[0].path)
    resolved = resolve_plan(store, LAYERS)
    assert resolved.plan.t_fail == 180
    assert {layer: r.step for layer, r in resolved.records.items()} == {"embed": 100, "block.0": 100, "norm": 180}
    assert renamed.version_id in resolved.skipped and len(resolved.skipped) == 3


def test_a_given_step_stays_whatever_is_rejected(history):
    """A live recovery's ``t_fail`` is the step the group reached: a rejected version changes the
    versions chosen, never that step."""
    store, written = history
    store.fs.delete(written[("block.0", 200)][0].shards[0].path)
    resolved = resolve_plan(store, LAYERS, 200)
    assert resolved.plan.t_fail == 200 and resolved.records["block.0"].step == 150


def test_falls_back_to_the_base(history):
    store, written = history
    _damage(store, written[("norm", 180)][0], "delete", rank=0)
    resolved = resolve_plan(store, LAYERS)
    assert resolved.records["norm"].base and resolved.records["norm"].step == 100
    _assert_loads(store, resolved.records["norm"], written[("norm", 100)][1])


def test_torn_commit_record_is_ignored(history):
    store, written = history
    bad = written[("norm", 180)][0]
    Path(store.fs.path(f"manifest/{bad.version_id}.json")).write_text('{"format": "layercheck.vers')
    manifest = store.manifest()
    assert bad.version_id not in manifest.by_id() and len(manifest.problems) == 1
    assert resolve_plan(store, LAYERS).records["norm"].step == 100


def test_no_usable_version_names_the_layer_and_what_was_tried(history):
    store, written = history
    _damage(store, written[("norm", 180)][0], "truncate")
    _damage(store, written[("norm", 100)][0], "flip-data", rank=0)
    with pytest.raises(NoUsableVersionError) as info:
        resolve_plan(store, LAYERS)
    message = str(info.value)
    assert "no usable version for norm" in message
    for step in (100, 180):
        assert written[("norm", step)][0].version_id in message


def test_earlier_failure_step(history):
    store, _ = history
    resolved = resolve_plan(store, LAYERS, t_fail=160)
    assert {layer: r.step for layer, r in resolved.records.items()} == {"embed": 100, "block.0": 150, "norm": 100}


def test_no_recovery_point_without_every_layer(tmp_path):
    store = LayerStore.open(str(tmp_path))
    write_layer(store, "embed", 100, base=True)
    with pytest.raises(NoUsableVersionError, match="block.0"):
        resolve_plan(store, LAYERS)


def test_composite_reader_serves_every_layer(history):
    from layercheck.orchestrator.store.composite_reader import CompositeReader

    store, written = history
    params = {layer: {f"{layer}.{n}": s for n, s in PARAMS.items()} for layer in LAYERS}
    states = {layer: layer_state(params[layer], seed=i) for i, layer in enumerate(LAYERS)}
    records = {
        layer: store.write_version(cut_shards(layer, 300, params[layer], states[layer], [0, 20, 48]))
        for layer in LAYERS
    }
    with CompositeReader(store, records) as read:
        assert {layer: m.optimizer_step for layer, m in read.metas().items()} == dict.fromkeys(LAYERS, 300)
        assert read.metas(["norm"])["norm"].groups[0]["name"] == "norm.decay"
        for layer in LAYERS:
            assert read(f"{layer}.w", "exp_avg", 3, 20).equal(states[layer]["exp_avg"][f"{layer}.w"][3:23])
        with pytest.raises(KeyError, match="'nope'"):
            read("nope", "fp32", 0, 1)
