"""Retention by reachability (pure) and garbage collection of a real store."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layercheck.orchestrator.store.gc import GcConfig, collect_garbage
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.recovery_source import resolve_plan
from layercheck.policies.plan import NoUsableVersionError, VersionRef, newest_recoverable_step, plan_recovery
from layercheck.policies.retention import RetentionConfig, plan_retention
from tests.support.store_helpers import PARAMS, cut_shards, even_cuts, faulty_store, layer_state, write_layer


def _v(layer, step, base=False):
    return VersionRef(step=step, layer=layer, version_id=f"{layer}@{step}{'b' if base else ''}", base=base)


HISTORY = [_v("A", 200, True), _v("B", 200, True), _v("A", 300), _v("A", 400), _v("B", 450), _v("A", 500)]


@pytest.mark.parametrize(
    "window,versions,kept",
    [
        (0, HISTORY, {"A@500", "B@450"}),
        (100, HISTORY, {"A@400", "A@500", "B@200b", "B@450"}),
        (300, HISTORY, {"A@200b", "A@300", "A@400", "A@500", "B@200b", "B@450"}),
        # B has nothing newer than the base: the whole base stays
        (0, [v for v in HISTORY if v.layer == "A"] + [_v("B", 200, True)], {"A@200b", "B@200b", "A@500"}),
        # no recovery point yet (B has no version): keep everything
        (0, [_v("A", 200), _v("A", 300)], {"A@200", "A@300"}),
        # at one step a non-base version wins over a base one (which stays as the base: nothing is newer)
        (0, [_v("A", 200, True), _v("A", 200), _v("B", 210)], {"A@200", "A@200b", "B@210"}),
        (0, [_v("A", 200, True), _v("A", 200), _v("A", 201), _v("B", 210)], {"A@201", "B@210"}),
    ],
)
def test_retention_table(window, versions, kept):
    layers = None if window or len({v.layer for v in versions}) > 1 else ["A", "B"]
    decision = plan_retention(versions, config=RetentionConfig(window=window), layers=layers)
    assert set(decision.keep) == kept
    assert decision.delete == {v.version_id for v in versions} - kept


@pytest.mark.parametrize("window", [-1, 1.5, True])
def test_window_must_be_a_non_negative_integer(window):
    with pytest.raises(ValueError, match="window"):
        RetentionConfig(window=window)


@st.composite
def histories(draw):
    versions = []
    for layer in ("embed", "block.0", "norm"):
        steps = draw(st.lists(st.integers(0, 60), min_size=0, max_size=6))
        for i, step in enumerate(steps):
            versions.append(VersionRef(step=step, layer=layer, version_id=f"{layer}#{i}", base=draw(st.booleans())))
    return versions, draw(st.integers(0, 30))


@settings(max_examples=300, deadline=None)
@given(histories())
def test_gc_never_deletes_what_a_recovery_point_in_the_window_needs(case):
    versions, window = case
    layers = {"embed": 1, "block.0": 1, "norm": 1}
    decision = plan_retention(versions, config=RetentionConfig(window=window), layers=list(layers))
    assert set(decision.keep).isdisjoint(decision.delete)
    assert set(decision.keep) | decision.delete == {v.version_id for v in versions}
    newest = newest_recoverable_step(list(layers), versions)
    if newest is None:
        assert not decision.delete
        return
    for t in range(newest - window, newest + 1):
        try:
            plan = plan_recovery(layers, versions, t)
        except NoUsableVersionError:
            continue
        assert {c.version.version_id for c in plan.choices} <= set(decision.keep)
    # and whatever GC keeps still recovers at the newest step
    kept = [v for v in versions if v.version_id in decision.keep]
    assert plan_recovery(layers, kept, newest) == plan_recovery(layers, versions, newest)


LAYERS = {"embed": 48, "block.0": 48, "norm": 48}


@pytest.fixture
def store(tmp_path):
    store = LayerStore.open(str(tmp_path))
    for layer in LAYERS:
        write_layer(store, layer, 100, base=True)
    for layer, step in (("block.0", 150), ("embed", 170), ("block.0", 200), ("norm", 180)):
        write_layer(store, layer, step)
    return store


def _ids(store):
    return {(r.layer, r.step) for r in store.versions()}


def test_gc_deletes_unreachable_versions_and_their_files(store, tmp_path):
    files_before = {p for p in tmp_path.rglob("*.safetensors")}
    dry = collect_garbage(store, GcConfig(dry_run=True))
    assert _ids(store) == {(layer, 100) for layer in LAYERS} | {
        ("block.0", 150),
        ("embed", 170),
        ("block.0", 200),
        ("norm", 180),
    }
    report = collect_garbage(store, GcConfig())
    assert (report.deleted_versions, report.freed_bytes) == (dry.deleted_versions, dry.freed_bytes)
    assert _ids(store) == {("block.0", 200), ("embed", 170), ("norm", 180)}
    assert len(files_before) - len(list(tmp_path.rglob("*.safetensors"))) == 2 * 4
    assert resolve_plan(store, LAYERS).plan.t_fail == 200
    for record in store.versions():
        assert store.check_version(record) == []


def test_gc_window_keeps_earlier_recovery_points(store):
    collect_garbage(store, GcConfig(retention=RetentionConfig(window=40)))
    # recovery at 160 needs embed's and norm's base, and block.0 at 150
    assert _ids(store) == {
        ("block.0", 150),
        ("block.0", 200),
        ("embed", 100),
        ("embed", 170),
        ("norm", 100),
        ("norm", 180),
    }
    resolved = resolve_plan(store, LAYERS, t_fail=160)
    assert {layer: r.step for layer, r in resolved.records.items()} == {"embed": 100, "block.0": 150, "norm": 100}


def test_gc_collects_orphans_only_past_the_grace_period(store, tmp_path):
    state = layer_state(PARAMS, seed=3)
    receipt = store.write_shard(cut_shards("norm", 220, PARAMS, state, even_cuts(48, 2))[0])  # never committed
    report = collect_garbage(store, GcConfig(grace_s=600))
    assert receipt.path not in report.orphans and (tmp_path / receipt.path).exists()
    report = collect_garbage(store, GcConfig(grace_s=600), now=time.time() + 601)
    assert report.orphans == (receipt.path,) and not (tmp_path / receipt.path).exists()


def test_gc_failures_are_reported_not_raised_and_lose_nothing(tmp_path):
    store, handler = faulty_store(str(tmp_path))
    for step in (100, 150):
        write_layer(store, "norm", step)
    handler.read_only = True
    report = collect_garbage(store, GcConfig())
    assert report.deleted_versions and report.errors and "Permission denied" in report.errors[0]
    assert len(store.versions()) == 2


def _p(layer, step):
    return VersionRef(step=step, layer=layer, version_id=f"{layer}@{step}p", partial=True, origin="capture")


@pytest.mark.parametrize(
    "versions,kept",
    [
        # a capture newer than every whole version: kept, and so is the whole one under it
        (HISTORY + [_p("B", 520)], {"A@500", "B@450", "B@520p"}),
        # a capture never makes an older whole version deletable, nor counts as B's newer version
        # (B has nothing newer than its base but the capture: the whole base stays)
        ([_v("A", 200, True), _v("B", 200, True), _v("A", 300), _p("B", 300)], {"A@200b", "A@300", "B@200b", "B@300p"}),
        # once a whole version at or after its step is committed, the capture goes
        (HISTORY + [_p("B", 450), _p("A", 450)], {"A@500", "B@450"}),
    ],
)
def test_partial_versions_are_kept_until_a_whole_version_catches_up(versions, kept):
    decision = plan_retention(versions, config=RetentionConfig(window=0))
    assert set(decision.keep) == kept
    assert decision.delete == {v.version_id for v in versions} - kept


def test_gc_keeps_a_capture_and_the_whole_version_under_it_and_recovery_still_overlays_it(store):
    state = layer_state(PARAMS, seed=9)
    shard = cut_shards("norm", 190, PARAMS, state, even_cuts(42, 2))[0]
    capture = store.commit([store.write_shard(shard, origin="capture")], partial=True)
    collect_garbage(store, GcConfig())
    assert _ids(store) == {("block.0", 200), ("embed", 170), ("norm", 180), ("norm", 190)}
    resolved = resolve_plan(store, LAYERS, t_fail=200)
    assert resolved.records["norm"].step == 180 and resolved.overlays["norm"] == (capture,)
    write_layer(store, "norm", 190)
    collect_garbage(store, GcConfig())
    assert capture.version_id not in {r.version_id for r in store.versions()}
    assert ("norm", 190) in _ids(store) and ("norm", 180) not in _ids(store)
