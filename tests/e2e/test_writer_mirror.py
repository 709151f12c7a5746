"""A writer's mirror copies (``persistence.memory_mirror``) on real writer actors: a writer that
learns its peer only after it has written (the writers of a run start in any order) sends the
peer what it already holds, so a lost node's early files are still in memory elsewhere; and an
older assignment of peers arriving last (the pool sends them from several threads) changes nothing."""

from __future__ import annotations

import pytest

from layercheck.orchestrator.runtime.wire import to_wire
from tests.support.store_helpers import PARAMS, cut_shards, even_cuts, layer_state
from tests.support.writer_sink import receipts_sink

pytestmark = pytest.mark.slow


def test_a_peer_assigned_after_the_writes_gets_the_files_already_held(local_ray, tmp_path):
    import math

    import ray

    from layercheck.orchestrator.runtime.writer_actor import WriterActor

    sink = receipts_sink()
    store = str(tmp_path / "run")
    lost = WriterActor.remote(store, False, sink, "lost-node", None, 2**20)
    head = WriterActor.remote(store, False, sink, "head", None, 2**20)
    total = sum(math.prod(s) for s in PARAMS.values())
    shards = cut_shards("block.0", 4, PARAMS, layer_state(PARAMS, seed=4), even_cuts(total, 2))
    assert ray.get(lost.submit.remote(to_wire(shards[0], base=False))) == "written"  # no peer yet: not mirrored
    (path, _), *_ = ray.get(lost.held.remote())
    assert ray.get(head.held.remote()) == []
    ray.get(lost.set_peer.remote(head, 1))
    assert _held_by(head, 1) == [(path, True)]
    assert bytes(ray.get(head.fetch.remote(path))) == bytes(ray.get(lost.fetch.remote(path)))

    # the pool's plan made before the head's writer started (no peer) arrives after the newer one
    ray.get(lost.set_peer.remote(None, 0))
    assert ray.get(lost.submit.remote(to_wire(shards[1], base=False))) == "written"
    assert len(_held_by(head, 2)) == 2, "a stale assignment took the writer's peer away"
    for actor in (lost, head, sink):
        ray.kill(actor)


def _held_by(writer, count: int) -> list:
    """What ``writer`` holds once it holds ``count`` files (mirror copies are sent without a wait)."""
    import ray

    held: list = []
    for _ in range(100):
        held = ray.get(writer.held.remote())
        if len(held) >= count:
            break
        ray.get(writer.drain.remote())
    return held
