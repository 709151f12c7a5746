"""A writer actor's host memory, accounted for against its process's real resident memory: a real
``WriterActor`` on a local Ray takes a few hundred MB of shards as the ranks hand them over
(``ray.put``, then ``submit``/``hold``): stored versions, memory versions, survivors' captures,
with its in-memory tier evicting as it goes. What it says it holds, by kind, must add up to its
process's own resident memory (``/proc``: all but the object store's shared pages), and that must
stay within its runtime + ``memory_bytes`` + the in-flight bound; nothing may refer to a hand-over
once it is written."""

from __future__ import annotations

import os

import pytest
import torch

from layercheck.orchestrator.core.memory.footprint import ENCODING_AT_ONCE
from layercheck.orchestrator.runtime.wire import to_wire
from layercheck.workers.shard import STATE_KEYS, LayerShard, ParamSlice
from tests.support.writer_sink import receipts_sink

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="a writer reads /proc")

LAYERS, RANKS = 12, 2
NUMEL = 1_000_000  # per rank and state key: a 12 MB shard file, 288 MB a version of every layer
BUDGET = 320 * 2**20  # one memory version of every layer and a few copies of stored files
SLACK = 32 * 2**20
"""Own resident memory a writer may have beyond its account: what its process grew by after its
start (its threads' allocator arenas, Python objects; 5 MiB here, 21 MiB on the demo). Before each
held file had a mapping of its own, freed files stayed resident: 159 MiB past the account here."""


def _shard(layer: int, step: int, rank: int) -> LayerShard:
    gen = torch.Generator().manual_seed(step * 1000 + layer * 10 + rank)
    return LayerShard(
        layer=f"block.{layer}",
        step=step,
        rank=rank,
        world_size=RANKS,
        slices=(ParamSlice(name="w", shape=(NUMEL * RANKS,), offset=rank * NUMEL, length=NUMEL),),
        tensors={key: torch.randn(NUMEL, generator=gen) for key in STATE_KEYS},
        optimizer_step=step,
        groups=({"name": f"block.{layer}", "lr": 1e-5, "params": ["w"]},),
    )


def _hand_over(writer, step: int, origin: str, method: str = "submit", layers: int = LAYERS) -> list:
    import ray

    calls = getattr(writer, method)
    return ray.get(
        [
            calls.remote(ray.put(to_wire(_shard(layer, step, rank), base=False, origin=origin)))
            for layer in range(layers)
            for rank in range(RANKS)
        ]
    )


def test_a_writer_holds_what_it_says_and_its_budget_bounds_it(local_ray, tmp_path):
    import ray

    from layercheck.orchestrator.runtime.writer_actor import WriterActor

    def live_hand_overs(writer) -> int:
        """Hand-overs (``WireShard``) anything in the writer's process still refers to."""
        import gc

        from layercheck.orchestrator.runtime.wire import WireShard

        return sum(isinstance(o, WireShard) for o in gc.get_objects())

    sink = receipts_sink()
    writer = WriterActor.remote(str(tmp_path / "run"), False, sink, "w", None, BUDGET)
    assert _hand_over(writer, 1, "policy") == ["written"] * LAYERS * RANKS  # copies of stored files
    for step in (2, 3):
        assert _hand_over(writer, step, "memory") == ["written"] * LAYERS * RANKS
    assert sum(_hand_over(writer, 4, "capture", "hold", layers=3)) > 0  # copied out, then written
    ray.get(writer.drain.remote())

    stats = ray.get(writer.get_stats.remote())
    host = stats.host
    assert host is not None and host.process is not None, "a writer on Linux reads its memory from /proc"
    held = host.held
    assert held.total_bytes == stats.memory_bytes <= BUDGET
    assert held.memory_version_bytes >= LAYERS * RANKS * 12 * NUMEL, "the newest memory version of every layer"
    assert held.stored_copy_bytes > 0 and held.mirror_bytes == 0  # (no peer: nothing mirrored)
    assert stats.memory_evicted > 0, "the budget was exercised"
    assert (host.in_flight_bytes, host.object_store_bytes, host.mirror_sending_bytes) == (0, 0, 0)
    assert ray.get(writer.__ray_call__.remote(live_hand_overs)) == 0

    # the account adds up to the process's own resident memory, now and at its peak
    unaccounted = host.unaccounted_bytes
    assert unaccounted is not None and abs(unaccounted) <= SLACK, host.to_json()
    shard_file = 12 * NUMEL + 2**16  # (its header: well under 64 KiB)
    in_flight_bound = (ENCODING_AT_ONCE + 1) * shard_file + 3 * RANKS * shard_file  # encodings + the captures
    assert host.peak_own_bytes <= host.runtime_bytes + BUDGET + in_flight_bound + SLACK, host.to_json()
    assert host.peak_unaccounted_bytes <= shard_file + SLACK, host.to_json()
    assert host.rss_parts() is not None and sum(host.rss_parts().values()) == host.process.rss_bytes
    for actor in (writer, sink):
        ray.kill(actor)
