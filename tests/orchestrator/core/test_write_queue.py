"""The writers' superseding queue (``layercheck.orchestrator.core.persistence.write_queue``): one pending shard
per layer and rank, a newer one replacing the unwritten older one."""

from layercheck.orchestrator.core.persistence.write_queue import SupersedingQueue


def test_superseding_queue_keeps_one_pending_shard_per_layer_and_rank():
    queue = SupersedingQueue(lambda item: item[1])
    assert queue.put(("embed", 0), ("embed@5", 100)) is None
    assert queue.put(("norm", 0), ("norm@5", 1)) is None
    assert queue.put(("embed", 1), ("embed@5 rank1", 100)) is None
    assert queue.put(("embed", 0), ("embed@9", 100)) == ("embed@5", 100)  # superseded, never written
    assert len(queue) == 3 and queue.nbytes == 201
    assert [queue.pop()[0] for _ in range(3)] == ["norm@5", "embed@5 rank1", "embed@9"]
    assert queue.pop() is None and queue.nbytes == 0
