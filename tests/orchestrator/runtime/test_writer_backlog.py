"""Two peered writer actors (``persistence.memory_mirror``), each handed more snapshots at once than
a Ray async actor runs calls by default (1000): a rank host's step-0 hand-over at 256 ranks on four
nodes did that (``bench/scale``). Every queued ``submit`` holds one of the actor's call slots until
its shard is written, and each write waits for its mirror copy to be taken by the peer, whose slots
were all held the same way: both writers stopped, for good, after a few files."""

from __future__ import annotations

import math

import pytest

from layercheck.orchestrator.runtime.wire import to_wire
from tests.support.store_helpers import PARAMS, cut_shards, even_cuts, layer_state
from tests.support.writer_sink import receipts_sink

pytestmark = pytest.mark.slow

#: Snapshots handed to each writer at once: past Ray's default of 1000 calls an async actor runs.
BACKLOG = 1100


def test_peered_writers_with_a_backlog_past_rays_call_limit_write_it_all(local_ray, tmp_path):
    import ray

    from layercheck.orchestrator.runtime.writer_actor import WriterActor

    sink = receipts_sink()
    store = str(tmp_path / "run")
    writers = [WriterActor.remote(store, False, sink, name, None, 64 * 2**20) for name in ("a", "b")]
    ray.get([writers[0].set_peer.remote(writers[1], 1), writers[1].set_peer.remote(writers[0], 1)])
    total = sum(math.prod(s) for s in PARAMS.values())
    state = layer_state(PARAMS, seed=1)
    wires = [
        ray.put(to_wire(cut_shards("block.0", step, PARAMS, state, even_cuts(total, 2))[rank], base=False))
        for step in range(1, BACKLOG + 1)
        for rank in (0, 1)
    ]
    submitted = [writers[i % 2].submit.remote(wire) for i, wire in enumerate(wires)]
    done, pending = ray.wait(submitted, num_returns=len(submitted), timeout=240)
    assert not pending, f"{len(pending)} of {len(submitted)} hand-overs never written"
    assert set(ray.get(done)) == {"written"}
    for actor in (*writers, sink):
        ray.kill(actor)
