"""A shard's wire form between the workers and the writer actors
(``layercheck.orchestrator.runtime.wire``): exact round trip, empty shards kept."""

import numpy as np
import torch

from layercheck.orchestrator.runtime.wire import from_wire, to_wire
from layercheck.workers.shard import LayerShard, ParamSlice


def test_wire_round_trip_is_exact_and_keeps_empty_shards():
    tensors = {k: torch.randn(6) for k in ("fp32", "exp_avg", "exp_avg_sq")}
    shard = LayerShard(
        layer="block.0",
        step=3,
        rank=1,
        world_size=2,
        slices=(ParamSlice("a", (2, 4), 2, 6),),
        tensors=tensors,
        optimizer_step=3,
        groups=({"name": "block.0/decay", "lr": 1e-3},),
    )
    wire = to_wire(shard, base=True)
    for a in wire.arrays.values():
        a.setflags(write=False)  # as the object store hands them out
    back = from_wire(wire)
    assert wire.base and back.slices == shard.slices and back.groups == shard.groups
    for key in tensors:
        assert torch.equal(back.tensors[key], tensors[key])
    empty = LayerShard(
        layer="norm",
        step=3,
        rank=1,
        world_size=2,
        slices=(),
        tensors={k: torch.empty(0) for k in tensors},
        optimizer_step=3,
    )
    assert from_wire(to_wire(empty, base=False)).numel == 0
    assert isinstance(wire.arrays["fp32"], np.ndarray)
