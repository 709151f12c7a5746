"""A commit record says which elements each rank file holds (``ShardEntry.slices``), so a reader
opens only the files holding what it reads: a recovering rank at N ranks read every rank file's
header of every version (N × layers headers each, N² × layers in all; ``bench/scale``)."""

import dataclasses
import json
import math

import pytest

from layercheck.orchestrator.store.errors import CorruptShardError
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import VersionRecord, encode_record, record_path
from layercheck.orchestrator.store.recovery_source import VersionReader, files_for, resolve_plan
from tests.support.store_helpers import PARAMS, write_layer

WORLD = 8


class Opens:
    """The store's opener, recording each file opened."""

    def __init__(self, store: LayerStore) -> None:
        self.store, self.paths = store, []

    def __call__(self, path: str):
        self.paths.append(path)
        return self.store.fs.open_input(path)


def test_the_record_names_each_files_slices_as_its_header_does(store):
    record, _ = write_layer(store, "block.0", 3, world_size=WORLD)
    (read,) = store.versions()
    assert read == record
    for entry, header in zip(read.shards, VersionReader(store, read).headers(), strict=True):
        assert entry.slices == tuple(header.slices)


def test_a_rank_reads_only_the_files_holding_its_range_and_one_for_the_metadata(store):
    record, state = write_layer(store, "block.0", 3, world_size=WORLD)
    opens = Opens(store)
    reader = VersionReader(LayerStore(store.fs, opener=opens), record)
    own = record.shards[5]
    for piece in own.slices:
        got = reader.read(piece.name, "exp_avg", piece.offset, piece.length)
        assert got.tolist() == state["exp_avg"][piece.name][piece.offset : piece.offset + piece.length].tolist()
    assert opens.paths == [own.path]
    assert reader.optimizer_step == 3
    assert opens.paths == [own.path, record.shards[0].path]  # the metadata: the first file's header
    needs = {p.name: [(p.offset, p.offset + p.length)] for p in own.slices}
    assert files_for([record], needs) == [record.shards[0].path, own.path]


def test_a_record_written_before_slices_were_kept_reads_every_header(store):
    record, state = write_layer(store, "block.0", 3, world_size=WORLD)
    old = dataclasses.replace(record, shards=tuple(dataclasses.replace(e, slices=None) for e in record.shards))
    data = json.loads(encode_record(old))
    assert all("slices" not in s for s in data["shards"])
    assert VersionRecord.from_json(data, source="old") == old
    opens = Opens(store)
    reader = VersionReader(LayerStore(store.fs, opener=opens), old)
    assert reader.read("b", "fp32", 0, 5).tolist() == state["fp32"]["b"].tolist()
    assert sorted(opens.paths) == sorted(e.path for e in record.shards)
    assert files_for([old], {"b": [(0, 5)]}) == [e.path for e in record.shards]


def test_a_file_whose_header_disagrees_with_the_records_slices_is_unusable(store):
    record, _ = write_layer(store, "block.0", 3, world_size=2)
    first, second = record.shards
    swapped = dataclasses.replace(first, slices=second.slices)  # a record that lies about rank 0's file
    lying = dataclasses.replace(record, shards=(swapped, second))
    store.fs.write_bytes(record_path(record.version_id), encode_record(lying))
    (read,) = store.versions()
    assert any("slices" in problem for problem in store.check_version(read, deep=False))
    with pytest.raises(CorruptShardError, match="slices"):
        VersionReader(store, read).read(second.slices[0].name, "fp32", second.slices[0].offset, 1)
    write_layer(store, "block.0", 1, world_size=2)
    plan = resolve_plan(store, {"block.0": sum(math.prod(shape) for shape in PARAMS.values())}, 3, deep=False)
    assert plan.records["block.0"].step == 1 and record.version_id in plan.skipped


def test_a_plan_checks_the_chosen_files_on_many_threads(store):
    """A plan checks every rank file of every layer it chooses: at N ranks N × layers round trips
    to storage, which one after another took minutes on an object store at 1,024 ranks."""
    import threading

    class Watched(LayerStore):
        threads: set = set()

        def check_shard(self, record, entry, *, deep):
            self.threads.add(threading.get_ident())
            return super().check_shard(record, entry, deep=deep)

    for layer in ("embed", "block.0", "norm"):
        write_layer(store, layer, 2, world_size=WORLD)
    watched = Watched(store.fs)
    numel = sum(math.prod(shape) for shape in PARAMS.values())
    plan = resolve_plan(watched, dict.fromkeys(("embed", "block.0", "norm"), numel), 2, deep=False)
    assert plan.plan.t_fail == 2 and not plan.skipped
    assert len(Watched.threads) > 1
