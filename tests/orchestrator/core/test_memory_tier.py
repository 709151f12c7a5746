"""The in-memory tier of recovery: the writers' shard cache (budget, superseding, eviction
order), the prepared-shard write path (the same file as the streaming one), and the memory-first
opener (hits, misses, a corrupt copy falls back to storage, counts by source)."""

from __future__ import annotations

import logging

import pytest
import torch

from layercheck.orchestrator.core.accounting import Recovery
from layercheck.orchestrator.core.memory.reads import (
    HeldHeader,
    LoadSources,
    MemoryFirstOpener,
    files_to_fetch,
    header_block,
)
from layercheck.orchestrator.core.memory.tier import HeldShard, ShardCache
from layercheck.orchestrator.store import tensorfile
from layercheck.orchestrator.store.composite_reader import CompositeReader
from layercheck.orchestrator.store.layer_store import LayerStore
from tests.support.store_helpers import PARAMS, cut_shards, even_cuts, layer_state


def held(layer: str, rank: int, step: int, nbytes: int = 100, *, origin: str = "policy", mirror: bool = False):
    return HeldShard(
        path=f"layers/{layer}/{step}-rank{rank}-{origin}{'-m' if mirror else ''}",
        layer=layer,
        rank=rank,
        step=step,
        origin=origin,
        data=memoryview(bytes(nbytes)),
        mirror=mirror,
    )


def test_a_newer_shard_supersedes_the_older_of_its_layer_and_rank():
    cache = ShardCache(10_000)
    old, new, other_rank = held("embed", 0, 10), held("embed", 0, 20), held("embed", 1, 10)
    for shard in (old, new, other_rank):
        assert cache.put(shard)
    assert cache.get(old.path) is None and cache.get(new.path) is new and cache.get(other_rank.path) is other_rank
    assert not cache.put(held("embed", 0, 15))  # an older one arriving late is refused
    stats = cache.stats()
    assert (stats.held_shards, stats.held_bytes, stats.superseded) == (2, 200, 2)


def test_a_capture_is_held_beside_the_version_it_overlays():
    cache = ShardCache(10_000)
    version, capture = held("block.0", 0, 10), held("block.0", 0, 12, origin="capture")
    assert cache.put(version) and cache.put(capture)
    assert cache.get(version.path) is version and cache.get(capture.path) is capture


def test_past_the_budget_the_oldest_step_goes_first_mirrors_before_own():
    cache = ShardCache(300)
    a, b_mirror, b_own = held("a", 0, 5), held("b", 1, 7, mirror=True), held("b", 0, 7)
    for shard in (b_own, a, b_mirror):
        assert cache.put(shard)
    assert cache.put(held("c", 0, 9))  # evicts a (step 5)
    assert cache.get(a.path) is None and cache.get(b_own.path) is b_own
    assert cache.put(held("d", 0, 10))  # evicts the mirror of step 7 before the own copy of step 7
    assert cache.get(b_mirror.path) is None and cache.get(b_own.path) is b_own
    stats = cache.stats()
    assert (stats.held_bytes, stats.held_shards, stats.evicted, stats.mirror_shards) == (300, 3, 2, 0)


def test_a_memory_version_goes_only_for_a_newer_one_and_a_dropped_one_is_counted_and_logged(caplog):
    """Memory versions (``persistence.memory_period``) live nowhere else: copies of stored files go
    first whatever their step, and a stored file's copy never evicts one; past that only an older
    memory version makes room for a newer, and each one let go is counted and logged."""
    cache = ShardCache(300)
    mem_a, mem_b, stored = held("a", 0, 7, origin="memory"), held("b", 0, 7, origin="memory"), held("c", 0, 8)
    for shard in (mem_a, mem_b, stored):
        assert cache.put(shard)
    assert cache.put(held("d", 0, 8, origin="memory"))  # the stored file's copy (step 8) goes, not step 7's
    assert cache.get(stored.path) is None and cache.get(mem_a.path) is mem_a and cache.get(mem_b.path) is mem_b
    assert not cache.put(held("e", 0, 9))  # a stored file's copy, however new, never evicts a memory version
    assert cache.get(mem_a.path) is mem_a and cache.get(mem_b.path) is mem_b
    assert cache.stats().memory_dropped == 0
    assert cache.put(held("a", 0, 8, origin="memory"))  # supersedes a@7 in its place
    with caplog.at_level(logging.WARNING, logger="layercheck.orchestrator.core.memory.tier"):
        assert cache.put(held("f", 0, 8, origin="memory"))  # the budget is short: the older b@7 goes
        assert cache.get(mem_b.path) is None
        assert not cache.put(held("g", 0, 8, origin="memory"))  # as new as every one held: not held
    stats = cache.stats()
    assert (stats.memory_dropped, stats.held_bytes, stats.held_shards) == (2, 300, 3)
    assert [r.getMessage().split(" of ")[1].split(" ")[0] for r in caplog.records] == ["b", "g"]
    assert "raise persistence.memory_bytes" in caplog.records[0].getMessage()


def test_a_shard_larger_than_the_budget_is_not_held_and_zero_turns_it_off():
    cache = ShardCache(150)
    small = held("a", 0, 1)
    assert cache.put(small) and not cache.put(held("b", 0, 2, nbytes=151))
    assert cache.get(small.path) is small and cache.stats().evicted == 1
    off = ShardCache(0)
    assert not off.enabled and not off.put(held("a", 0, 1)) and off.stats().held_bytes == 0
    with pytest.raises(ValueError, match="budget_bytes"):
        ShardCache(-1)


def test_the_same_file_again_replaces_it_without_counting_twice():
    cache = ShardCache(1000)
    shard = held("a", 0, 1)
    assert cache.put(shard) and cache.put(shard)
    assert cache.stats().held_bytes == 100 and list(cache.paths()) == [(shard.path, False)]


def _shards(step: int = 3, world: int = 2):
    state = layer_state(PARAMS, seed=step)
    total = sum(torch.Size(s).numel() for s in PARAMS.values())
    return cut_shards("block.0", step, PARAMS, state, even_cuts(total, world))


def test_a_prepared_shard_is_the_file_write_shard_writes(tmp_path):
    store = LayerStore.open(str(tmp_path / "run"), fsync=False)
    shard = _shards()[0]
    events = []
    store.fs = type(store.fs)(fs=store.fs.fs, root=store.fs.root, hook=lambda e, rel: events.append(e))
    streamed = store.write_shard(shard)
    prepared = store.prepare_shard(shard)
    written = store.write_prepared(prepared)
    assert written == prepared.receipt and written.path != streamed.path
    assert (written.nbytes, written.checksum) == (streamed.nbytes, streamed.checksum)
    assert store.fs.read_bytes(written.path) == store.fs.read_bytes(streamed.path) == prepared.encoded.data.to_pybytes()
    assert events == ["opened", "partial", "closed", "renamed"] * 2  # a stall hook fires mid-write on both paths


def _committed(tmp_path):
    store = LayerStore.open(str(tmp_path / "run"), fsync=False)
    prepared = [store.prepare_shard(s) for s in _shards()]
    record = store.commit([store.write_prepared(p) for p in prepared])
    memory = {p.receipt.path: p.encoded.data.to_pybytes() for p in prepared}
    return store, record, memory


def test_the_opener_loads_from_memory_and_counts_by_source(tmp_path):
    store, record, memory = _committed(tmp_path)
    expected = {}
    with CompositeReader(store, {"block.0": record}) as read:
        expected = {name: read(name, "fp32", 0, torch.Size(shape).numel()) for name, shape in PARAMS.items()}
    only_rank0 = {record.shards[0].path: memory[record.shards[0].path]}
    opener = MemoryFirstOpener(
        candidates=lambda path: [("memory_remote", only_rank0[path])] if path in only_rank0 else [],
        open_storage=store.fs.open_input,
    )
    reading = LayerStore(store.fs, opener=opener)
    with CompositeReader(reading, {"block.0": record}) as read:
        got = {name: read(name, "fp32", 0, torch.Size(shape).numel()) for name, shape in PARAMS.items()}
    assert all(torch.equal(got[n], expected[n]) for n in PARAMS)
    sources = opener.sources
    assert (sources.memory_remote_shards, sources.storage_shards, sources.memory_local_shards) == (1, 1, 0)
    # rank 0's file whole from memory; from storage, its header (read before the body was
    # wanted), and of rank 1's file the header and the fp32 tensors only: never a byte twice
    headers = [tensorfile.read_header(store.fs.open_input(e.path), path=e.path) for e in record.shards]
    header_bytes = [min(entry.offset for entry in h.entries.values()) for h in headers]
    fp32 = sum(e.length * 4 for name, e in headers[1].entries.items() if name.startswith("fp32/"))
    assert sources.memory_remote_bytes == record.shards[0].nbytes
    assert sources.storage_bytes == header_bytes[0] + header_bytes[1] + fp32


def test_a_rank_reads_only_its_own_file_from_memory(tmp_path):
    """At the world size a version was written at, a rank's slices are its own file: the record
    says which file holds what, so no other rank's file is read, not even its header, and storage
    is never touched."""
    store, record, memory = _committed(tmp_path)
    headers = {path: HeldHeader("memory_local", header_block(data), len(data)) for path, data in memory.items()}
    own = record.shards[1].path
    needs: dict[str, list[tuple[int, int]]] = {}
    for piece in tensorfile.read_header(store.fs.open_input(own), path=own).slices:  # rank 1's slices
        needs.setdefault(piece.name, []).append((piece.offset, piece.offset + piece.length))
    assert files_to_fetch(headers, needs) == [own]
    fetched = []

    def candidates(path):
        fetched.append(path)
        return [("memory_local", memory[path])]

    def no_storage(path):
        raise AssertionError(f"storage was read for {path}")

    opener = MemoryFirstOpener(candidates=candidates, open_storage=no_storage, headers=headers)
    with CompositeReader(LayerStore(store.fs, opener=opener), {"block.0": record}) as read:
        for name, spans in needs.items():
            for start, end in spans:
                for key in ("fp32", "exp_avg", "exp_avg_sq"):
                    read(name, key, start, end - start)
    assert fetched == [own]
    assert opener.sources.memory_local_bytes == record.shards[1].nbytes
    assert opener.sources.memory_local_shards == 1 and opener.sources.storage_bytes == 0


def test_a_corrupt_copy_in_memory_falls_back_to_the_next_then_storage(tmp_path):
    store, record, memory = _committed(tmp_path)
    good, bad = {}, {}
    for path, data in memory.items():
        flipped = bytearray(data)
        flipped[-3] ^= 0xFF  # inside the last tensor: the header parses, a checksum fails
        bad[path], good[path] = bytes(flipped), data
    first = record.shards[0].path
    opener = MemoryFirstOpener(
        candidates=lambda path: iter(
            [("memory_local", bad[path])] + ([("memory_remote", good[path])] if path == first else [])
        ),
        open_storage=store.fs.open_input,
    )
    reading = LayerStore(store.fs, opener=opener)
    with CompositeReader(reading, {"block.0": record}) as read:
        for name, shape in PARAMS.items():
            read(name, "exp_avg_sq", 0, torch.Size(shape).numel())  # no CorruptShardError: the store is sound
    sources = opener.sources
    assert (sources.memory_rejected, sources.memory_remote_shards, sources.storage_shards) == (2, 1, 1)


def test_a_recovery_adds_up_the_ranks_sources():
    recovery = Recovery(t_fail=9, resumed_at=10, detect_restart_s=1.0)
    one = LoadSources()
    one.add("memory_local", 40)
    one.add("storage", 7)
    recovery.add_sources(one.to_json())
    recovery.add_sources(one.to_json())
    assert (recovery.memory_local_bytes, recovery.memory_local_shards, recovery.storage_bytes) == (80, 2, 14)
    with pytest.raises(ValueError, match="source"):
        one.add("disk", 1)
