"""Recovery reads per (layer, element range): a survivor's capture (a partial version holding
only some ranks' slices) overlaid on a layer's whole version, through the real store."""

import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layercheck.orchestrator.store.composite_reader import CompositeReader
from layercheck.orchestrator.store.errors import CorruptShardError
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.recovery_source import resolve_plan
from layercheck.workers.shard import STATE_KEYS
from tests.support.store_helpers import PARAMS, cut_shards, even_cuts, layer_state

TOTAL = sum(math.prod(s) for s in PARAMS.values())  # 42
NUMEL = {"norm": TOTAL}
OFFSETS = {"w": 0, "b": 30, "g": 35}  # cut_shards lays the parameters end to end in this order


def _whole(store, step, seed, world_size=2, base=False):
    state = layer_state(PARAMS, seed=seed)
    return store.write_version(cut_shards("norm", step, PARAMS, state, even_cuts(TOTAL, world_size)), base=base), state


def _partial(store, step, seed, cuts, ranks, origin="capture"):
    state = layer_state(PARAMS, seed=seed)
    shards = cut_shards("norm", step, PARAMS, state, cuts)
    receipts = [store.write_shard(shards[r], origin=origin) for r in ranks]
    return store.commit(receipts, partial=True), state


def _expected(layers):
    """The composite, element by element: the first of ``layers`` (state, covered [lo, hi) of
    the end-to-end layout, newest first) that holds the element."""
    out = {}
    for key in STATE_KEYS:
        for name, shape in PARAMS.items():
            values = []
            for i in range(math.prod(shape)):
                flat = OFFSETS[name] + i
                state = next(s for s, spans in layers if any(lo <= flat < hi for lo, hi in spans))
                values.append(state[key][name][i])
            out[key, name] = torch.stack(values)
    return out


def test_a_capture_of_rank_0_overlays_the_whole_version(tmp_path):
    store = LayerStore.open(str(tmp_path))
    _, old = _whole(store, 10, seed=1, base=True)
    capture, new = _partial(store, 14, seed=2, cuts=even_cuts(TOTAL, 2), ranks=[0])
    resolved = resolve_plan(store, NUMEL, t_fail=14)
    assert resolved.overlays == {"norm": (capture,)}
    (choice,) = resolved.plan.choices
    assert [(s.origin, s.step, s.ranks, s.elements) for s in resolved.sources["norm"]] == [
        ("capture", 14, (0,), 21),
        ("policy", 10, (0, 1), 21),
    ]
    assert choice.staleness == resolved.plan.max_staleness == 4
    assert resolved.plan.weighted_staleness == pytest.approx(2.0)
    expected = _expected([(new, [(0, 21)]), (old, [(0, TOTAL)])])
    with CompositeReader(store, resolved.records, overlays=resolved.overlays) as read:
        assert read.metas()["norm"].optimizer_step == 14
        for (key, name), values in expected.items():
            assert read(name, key, 0, len(values)).equal(values), (key, name)
        assert read("w", "fp32", 19, 4).equal(expected["fp32", "w"][19:23])  # across the capture's edge


def test_a_capture_after_t_fail_is_passed_over(tmp_path):
    store = LayerStore.open(str(tmp_path))
    _whole(store, 10, seed=1, base=True)
    capture, _ = _partial(store, 14, seed=2, cuts=even_cuts(TOTAL, 2), ranks=[0])
    resolved = resolve_plan(store, NUMEL, t_fail=13)
    assert resolved.overlays == {} and "after t_fail 13" in resolved.plan.passed_over[capture.version_id]
    assert resolved.plan.max_staleness == 3


def test_a_corrupt_capture_names_itself_and_the_next_plan_skips_it(tmp_path):
    store = LayerStore.open(str(tmp_path))
    _, old = _whole(store, 10, seed=1, base=True)
    capture, _ = _partial(store, 14, seed=2, cuts=even_cuts(TOTAL, 2), ranks=[0])
    path = Path(store.fs.path(capture.shards[0].path))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x55
    path.write_bytes(bytes(data))
    shallow = resolve_plan(store, NUMEL, t_fail=14, deep=False)  # headers are fine: the reader finds it
    with CompositeReader(store, shallow.records, overlays=shallow.overlays) as read:
        with pytest.raises(CorruptShardError) as caught:
            for key in STATE_KEYS:
                for name, shape in PARAMS.items():
                    read(name, key, 0, math.prod(shape))
    assert caught.value.version_id == capture.version_id
    replanned = resolve_plan(store, NUMEL, t_fail=14, deep=False, skip={capture.version_id: str(caught.value)})
    assert replanned.overlays == {} and [s.step for s in replanned.sources["norm"]] == [10]
    deep = resolve_plan(store, NUMEL, t_fail=14)
    assert deep.overlays == {} and capture.version_id in deep.skipped


@st.composite
def overlay_histories(draw):
    """Up to three partial versions at steps 11..13 over a whole one at 10, each cut at its own
    world size and holding a random subset of its ranks."""
    partials = []
    for step in draw(st.lists(st.integers(11, 13), unique=True, max_size=3)):
        world_size = draw(st.integers(1, 4))
        inner = sorted(draw(st.lists(st.integers(0, TOTAL), min_size=world_size - 1, max_size=world_size - 1)))
        ranks = draw(st.lists(st.integers(0, world_size - 1), unique=True, min_size=1).map(sorted))
        partials.append((step, [0, *inner, TOTAL], ranks))
    return draw(st.integers(1, 3)), partials


@settings(max_examples=15, deadline=None)
@given(overlay_histories())
def test_every_element_comes_from_the_newest_version_holding_it(case):
    base_world, partials = case
    with tempfile.TemporaryDirectory() as root:
        store = LayerStore.open(root, fsync=False)
        _, old = _whole(store, 10, seed=1, world_size=base_world, base=True)
        layers = [(old, [(0, TOTAL)])]
        for step, cuts, ranks in partials:
            _, state = _partial(store, step, seed=step, cuts=cuts, ranks=ranks, origin="policy")
            layers.append((state, [(cuts[r], cuts[r + 1]) for r in ranks], step))
        newest_first = sorted(layers[1:], key=lambda x: -x[2])
        expected = _expected([(s, spans) for s, spans, _ in newest_first] + [layers[0]])
        resolved = resolve_plan(store, NUMEL, t_fail=13, deep=False)
        assert sum(s.elements for s in resolved.sources["norm"]) == TOTAL
        with CompositeReader(store, resolved.records, overlays=resolved.overlays) as read:
            for (key, name), values in expected.items():
                assert read(name, key, 0, len(values)).equal(values)
                assert read(name, key, 1, len(values) - 2).equal(values[1:-1])
        supplying = [s.step for s in resolved.sources["norm"] if s.elements]
        assert resolved.plan.max_staleness == 13 - min(supplying)
