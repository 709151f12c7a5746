"""Memory versions (``persistence.memory_period``): every rank's shard of a layer held by the
writers, never stored, is a whole version the recovery plan weighs with the stored ones, usable
while the writers hold its files."""

from __future__ import annotations

import math

import pytest

from layercheck.orchestrator.core.memory.versions import MemoryVersions
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import MEMORY_ORIGIN
from layercheck.orchestrator.store.recovery_source import resolve_plan
from tests.support.store_helpers import PARAMS, cut_shards, even_cuts, layer_state, write_layer

TOTAL = sum(math.prod(shape) for shape in PARAMS.values())


def held(store: LayerStore, layer: str, step: int, world_size: int = 2):
    """What each rank's writer holds of a memory version: its shard files (receipts) and their bytes."""
    shards = cut_shards(layer, step, PARAMS, layer_state(PARAMS, seed=step), even_cuts(TOTAL, world_size))
    return [store.prepare_shard(shard, origin=MEMORY_ORIGIN) for shard in shards]


def test_a_memory_version_is_whole_once_every_ranks_shard_is_held_and_the_newest_stays(tmp_path):
    store = LayerStore.open(str(tmp_path), fsync=False)
    versions = MemoryVersions()
    first, second = held(store, "embed", 3), held(store, "embed", 6)
    assert versions.add(first[0].receipt) is None  # rank 1's is not in yet
    assert versions.add(second[0].receipt) is None
    record = versions.add(first[1].receipt)
    assert record is not None and (record.layer, record.step, record.origin) == ("embed", 3, MEMORY_ORIGIN)
    assert [s.path for s in record.shards] == [p.receipt.path for p in first]
    newer = versions.add(second[1].receipt)
    assert versions.records() == [newer] and newer.step == 6 and versions.held == 2
    assert versions.add(first[0].receipt) is None  # an older one arriving late changes nothing
    versions.forget_after(5)  # a group lost after step 5: its step-6 state is not the run's
    assert versions.records() == []
    scheduled = cut_shards("norm", 1, PARAMS, layer_state(PARAMS, seed=1), even_cuts(TOTAL, 2))[0]
    with pytest.raises(ValueError, match="not a memory version"):
        versions.add(store.prepare_shard(scheduled).receipt)


def test_the_plan_takes_a_held_memory_version_over_an_older_stored_one_and_falls_back_when_it_is_gone(tmp_path):
    store = LayerStore.open(str(tmp_path), fsync=False)
    numel = {"embed": TOTAL}
    write_layer(store, "embed", 4)
    versions = MemoryVersions()
    memory = held(store, "embed", 6)
    for prepared in memory:
        versions.add(prepared.receipt)
    paths = {p.receipt.path for p in memory}
    resolved = resolve_plan(store, numel, 7, memory=versions.records(), held=paths)
    assert resolved.records["embed"].origin == MEMORY_ORIGIN and resolved.records["embed"].step == 6
    assert resolved.plan.max_staleness == 1
    gone = resolve_plan(store, numel, 7, memory=versions.records(), held=paths - {memory[1].receipt.path})
    assert gone.records["embed"].step == 4 and gone.records["embed"].origin == "policy"
    (why,) = gone.skipped.values()
    assert "no longer hold 1 of its 2 files in memory" in why
    before = resolve_plan(store, numel, 5, memory=versions.records(), held=paths)  # t_fail before it
    assert before.records["embed"].step == 4
