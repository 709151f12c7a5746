"""A writer's mirror copies (``persistence.memory_mirror``) on real writer actors: a writer that
learns its peer only after it has written (the writers of a run start in any order) sends the
peer what it already holds, so a lost node's early files are still in memory elsewhere."""

from __future__ import annotations

import pytest

from layercheck.orchestrator.runtime.wire import to_wire
from tests.support.store_helpers import PARAMS, cut_shards, even_cuts, layer_state

pytestmark = pytest.mark.slow


def test_a_peer_assigned_after_the_writes_gets_the_files_already_held(local_ray, tmp_path):
    import math

    import ray

    from layercheck.orchestrator.runtime.writer_actor import PersistenceWriter

    @ray.remote(num_cpus=0)
    class Receipts:
        def shard_written(self, receipt, write_s):
            pass

        def write_failed(self, layer, step, rank, error):
            raise RuntimeError(error)

    sink = Receipts.remote()
    store = str(tmp_path / "run")
    lost = PersistenceWriter.remote(store, False, sink, "lost-node", None, None, 2**20)
    head = PersistenceWriter.remote(store, False, sink, "head", None, None, 2**20)
    total = sum(math.prod(s) for s in PARAMS.values())
    shards = cut_shards("block.0", 4, PARAMS, layer_state(PARAMS, seed=4), even_cuts(total, 2))
    assert ray.get(lost.submit.remote(to_wire(shards[0], base=False))) == "written"  # no peer yet: not mirrored
    (path, _), *_ = ray.get(lost.held.remote())
    assert ray.get(head.held.remote()) == []
    ray.get(lost.set_peer.remote(head))
    ray.get(lost.drain.remote())
    mirrored = None
    for _ in range(100):  # the copy is sent without waiting for it
        mirrored = ray.get(head.held.remote())
        if mirrored:
            break
        ray.get(head.drain.remote())
    assert mirrored == [(path, True)]
    assert bytes(ray.get(head.fetch.remote(path))) == bytes(ray.get(lost.fetch.remote(path)))
    for actor in (lost, head, sink):
        ray.kill(actor)
