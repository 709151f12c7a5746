"""The shard file format: safetensors written over pyarrow streams, range reads, checksums."""

import math

import pyarrow.fs as pafs
import pytest
import torch
from safetensors import safe_open

from layercheck.orchestrator.store import tensorfile
from layercheck.orchestrator.store.errors import ShardFormatError
from layercheck.workers.shard import STATE_KEYS
from tests.support.store_helpers import PARAMS, cut_shards, even_cuts, layer_state

TOTAL = sum(math.prod(s) for s in PARAMS.values())


def _write(path, shard, base=False):
    with pafs.LocalFileSystem().open_output_stream(str(path)) as stream:
        return tensorfile.write_shard(stream, shard, base=base)


@pytest.fixture
def shard_file(tmp_path):
    state = layer_state(PARAMS, seed=1)
    shard = cut_shards("block.1", 40, PARAMS, state, even_cuts(TOTAL, 3))[1]  # spans two params
    path = tmp_path / "s.safetensors"
    digest = _write(path, shard, base=True)
    return path, shard, digest


def test_round_trip_and_digest(shard_file):
    path, shard, digest = shard_file
    assert digest.nbytes == path.stat().st_size
    with pafs.LocalFileSystem().open_input_file(str(path)) as f:
        header = tensorfile.read_header(f, path=str(path))
        back = tensorfile.load_shard(f, path=str(path))
    assert header.checksum == digest.checksum and header.base and header.file_nbytes == digest.nbytes
    assert (back.layer, back.step, back.rank, back.world_size, back.optimizer_step) == ("block.1", 40, 1, 3, 40)
    assert back.slices == shard.slices and back.groups == shard.groups
    for key in STATE_KEYS:
        assert torch.equal(back.tensors[key], shard.tensors[key])


def test_official_safetensors_reads_it(shard_file):
    path, shard, _ = shard_file
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["layer"] == "block.1"
        assert set(f.keys()) == {tensorfile.entry_name(k, s.name) for k in STATE_KEYS for s in shard.slices}
        for key in STATE_KEYS:
            for index, piece in enumerate(shard.slices):
                assert torch.equal(f.get_tensor(tensorfile.entry_name(key, piece.name)), shard.view(key, index))


def test_range_read_fetches_only_the_range(shard_file):
    path, shard, _ = shard_file
    piece = shard.slices[0]
    with pafs.LocalFileSystem().open_input_file(str(path)) as f:
        entry = tensorfile.read_header(f, path="x").entries[tensorfile.entry_name("exp_avg", piece.name)]
        part = tensorfile.read_entry(f, entry, path="x", start=2, count=3, verify=False)
    assert torch.equal(torch.from_numpy(part.copy()), shard.view("exp_avg", 0)[2:5])


def test_a_flipped_byte_fails_that_entry_only(shard_file):
    path, shard, _ = shard_file
    with pafs.LocalFileSystem().open_input_file(str(path)) as f:
        header = tensorfile.read_header(f, path="x")
    victim = header.entries[tensorfile.entry_name("exp_avg_sq", shard.slices[-1].name)]
    data = bytearray(path.read_bytes())
    data[victim.offset + 1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pafs.LocalFileSystem().open_input_file(str(path)) as f:
        header = tensorfile.read_header(f, path=str(path))  # the header itself is intact
        with pytest.raises(ShardFormatError, match="fails its checksum"):
            tensorfile.read_entry(f, header.entries[victim.name], path=str(path))
        other = header.entries[tensorfile.entry_name("fp32", shard.slices[-1].name)]
        tensorfile.read_entry(f, other, path=str(path))


@pytest.mark.parametrize("keep", [0, 5, 40, -4])
def test_truncated_file_is_named(shard_file, keep):
    path, _, _ = shard_file
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    with pafs.LocalFileSystem().open_input_file(str(path)) as f:
        with pytest.raises(ShardFormatError, match="truncated|too short|exceeds"):
            tensorfile.read_header(f, path=str(path))


def test_refuses_non_json_groups_and_duplicate_params(tmp_path):
    state = layer_state(PARAMS, seed=2)
    shard = cut_shards("norm", 3, PARAMS, state, even_cuts(TOTAL, 1))[0]
    shard.groups = ({"lr": object()},)
    with pytest.raises(ValueError, match="JSON-safe"):
        _write(tmp_path / "a", shard)
    shard.groups = ()
    shard.slices = shard.slices + shard.slices[:1]
    shard.tensors = {k: torch.cat([v, v[: shard.slices[0].length]]) for k, v in shard.tensors.items()}
    with pytest.raises(ValueError, match="twice"):
        _write(tmp_path / "b", shard)


def test_an_encoded_shard_holds_its_file_size_and_gives_it_back(tmp_path):
    """The writers keep encoded shard files in memory against ``persistence.memory_bytes``: such
    a file must take its own size, and all of it must go back to the system once let go. (A
    growing ``pa.BufferOutputStream`` reserved 32 MiB from pyarrow's pool for this 24 MB file.)"""
    import pyarrow as pa

    from layercheck.orchestrator.core.memory.footprint import process_memory

    params = {"w": (1000, 2000)}  # 2M elements: 24 MB of weights and moments
    shard = cut_shards("block.0", 3, params, layer_state(params, seed=2), even_cuts(2_000_000, 1))[0]
    _write(tmp_path / "s.safetensors", shard)
    assert tensorfile.encode_shard(shard).data.to_pybytes() == (tmp_path / "s.safetensors").read_bytes()
    pool = pa.default_memory_pool()
    before, pooled = process_memory(), pool.bytes_allocated()
    encoded = tensorfile.encode_shard(shard)
    held = process_memory()
    assert before is not None and held is not None
    assert encoded.data.size == encoded.digest.nbytes > 24_000_000
    assert pool.bytes_allocated() - pooled == 0, "a large file lives in a mapping of its own, not in the pool"
    assert held.anon_bytes - before.anon_bytes >= encoded.data.size - 2**20
    del encoded
    after = process_memory()
    assert after is not None and after.anon_bytes - before.anon_bytes < 2**20, "its memory was not given back"
