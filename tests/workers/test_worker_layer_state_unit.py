"""Range reading across slicings, shard metadata, host-buffer reuse and ZeRO-0 ownership (no DeepSpeed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.layer_state import ShardReader, metas_of
from layercheck.workers.layout import zero0_owned_range
from layercheck.workers.shard import STATE_KEYS, LayerShard, ParamSlice

SHAPES = {"a.weight": (7, 3), "a.bias": (5,)}


def _full(name: str, key: str) -> torch.Tensor:
    n = torch.Size(SHAPES[name]).numel()
    return torch.arange(n, dtype=torch.float32) + 1000 * list(SHAPES).index(name) + 100_000 * STATE_KEYS.index(key)


def _shards(world_size: int, step: int = 5) -> list[LayerShard]:
    """The layer split the ZeRO-0 way over ``world_size`` ranks."""
    out = []
    for rank in range(world_size):
        slices = []
        for name, shape in SHAPES.items():
            offset, length = zero0_owned_range(torch.Size(shape).numel(), rank, world_size)
            slices.append(ParamSlice(name, shape, offset, length))
        tensors = {k: torch.cat([_full(s.name, k)[s.offset : s.offset + s.length] for s in slices]) for k in STATE_KEYS}
        out.append(
            LayerShard(
                layer="a",
                step=step,
                rank=rank,
                world_size=world_size,
                slices=tuple(slices),
                tensors=tensors,
                optimizer_step=step,
                groups=({"name": "a/decay", "eps": 1e-8},),
            )
        )
    return out


@given(st.integers(1, 5), st.sampled_from(list(SHAPES)), st.sampled_from(STATE_KEYS), st.data())
def test_reader_serves_any_range_from_any_world_size(world_size, name, key, data):
    n = torch.Size(SHAPES[name]).numel()
    offset = data.draw(st.integers(0, n - 1))
    length = data.draw(st.integers(1, n - offset))
    got = ShardReader(_shards(world_size))(name, key, offset, length)
    assert torch.equal(got, _full(name, key)[offset : offset + length])


def test_reader_names_a_missing_range():
    some = _shards(3)[:2]  # rank 2's elements are absent
    reader = ShardReader(some)
    with pytest.raises(KeyError, match="a.weight"):
        reader("a.weight", "fp32", 0, 21)
    with pytest.raises(KeyError, match="nope"):
        reader("nope", "fp32", 0, 1)


def test_metas_of_checks_shards_agree():
    metas = metas_of(_shards(2))
    assert metas["a"].optimizer_step == 5 and metas["a"].groups[0]["name"] == "a/decay"
    with pytest.raises(ValueError, match="different steps"):
        metas_of(_shards(2, step=5)[:1] + _shards(2, step=6)[1:])


@given(st.integers(0, 50), st.integers(1, 8))
def test_zero0_slices_tile_the_parameter(numel, world_size):
    ranges = [zero0_owned_range(numel, r, world_size) for r in range(world_size)]
    position = 0
    for offset, length in ranges:
        if length:
            assert offset == position
            position += length
    assert position == numel


def test_pool_reuses_released_buffers_and_leaves_foreign_tensors():
    pool = HostBufferPool()
    assert pool.pin == torch.cuda.is_available()
    first = {k: pool.acquire(12) for k in STATE_KEYS}
    shard = LayerShard(
        layer="x",
        step=1,
        rank=0,
        world_size=1,
        slices=(ParamSlice("p", (12,), 0, 12),),
        tensors=first,
        optimizer_step=1,
    )
    allocated = pool.allocated_bytes
    assert pool.lent == 3
    pool.release(shard)
    pool.release(shard)  # twice is harmless
    assert pool.lent == 0
    again = {pool.acquire(12).data_ptr() for _ in STATE_KEYS}
    assert again == {t.data_ptr() for t in first.values()}
    assert pool.allocated_bytes == allocated
    foreign = LayerShard(
        layer="x",
        step=1,
        rank=0,
        world_size=1,
        slices=(ParamSlice("p", (2,), 0, 2),),
        tensors={k: torch.zeros(2) for k in STATE_KEYS},
        optimizer_step=1,
    )
    pool.release(foreign)
    assert pool.acquire(2).data_ptr() not in {t.data_ptr() for t in foreign.tensors.values()}
