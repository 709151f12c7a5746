"""The local runtime's writer and committer, in one process: a newer snapshot of a layer
supersedes an unwritten one, the byte bound makes the trainer wait, receipts travel through the
in-memory mailbox, and a version is committed only once every rank's shard is in. A store hook
holds the writer inside a write, so every interleaving here is scripted, not timed."""

from __future__ import annotations

import math
import threading

import pytest
import torch.distributed as dist

from orchestrator.local.committer import Committer
from orchestrator.local.mailbox import Mailbox
from orchestrator.local.spawn import RanksFailedError, spawn_ranks
from orchestrator.local.writer import LocalWriter
from orchestrator.store.layer_store import LayerStore
from tests.store_helpers import PARAMS, cut_shards, even_cuts, layer_state

TOTAL = sum(math.prod(s) for s in PARAMS.values())


def shards(layer: str, step: int, world_size: int = 2):
    return cut_shards(layer, step, PARAMS, layer_state(PARAMS, seed=step), even_cuts(TOTAL, world_size))


@pytest.fixture
def mailbox():
    return Mailbox(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))


class Gate:
    """A store hook that holds the first write open until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, event: str, rel: str) -> None:
        if event == "opened" and not self.entered.is_set():
            self.entered.set()
            self.release.wait(timeout=60)


def test_a_newer_snapshot_supersedes_an_unwritten_one_and_the_byte_bound_waits(tmp_path, mailbox):
    gate = Gate()
    store = LayerStore.open(str(tmp_path), fsync=False, hook=gate)
    one = shards("block.0", 1)[0]
    writer = LocalWriter(store, mailbox, max_inflight_bytes=2 * one.nbytes)
    writer.submit(one, base=False)
    assert gate.entered.wait(timeout=60)  # the writer is inside step 1's write
    writer.submit(shards("block.1", 2)[0], base=False)
    writer.submit(shards("block.1", 3)[0], base=False)  # replaces step 2, still queued
    assert writer.stats.superseded == 1 and writer.inflight_bytes == 2 * one.nbytes
    blocked = threading.Thread(target=writer.submit, args=(shards("block.0", 4)[0],), kwargs={"base": False})
    blocked.start()  # 3 shards' bytes in flight > the bound of 2: waits for storage
    blocked.join(timeout=0.5)
    assert blocked.is_alive()
    gate.release.set()
    blocked.join(timeout=60)
    assert not blocked.is_alive() and writer.stats.blocked_s > 0
    assert writer.drain(timeout_s=60)
    writer.close()
    taken = [mailbox.take() for _ in range(3)]
    assert sorted((r["layer"], r["step"]) for r in taken) == [("block.0", 1), ("block.0", 4), ("block.1", 3)]
    assert mailbox.posted() == 3


def test_a_version_is_committed_only_once_every_rank_shard_is_in(tmp_path, mailbox):
    store = LayerStore.open(str(tmp_path), fsync=False)
    committer = Committer(store, mailbox)
    rank0, rank1 = (store.write_shard(s) for s in shards("embed", 5))
    mailbox.post(rank0.to_json())
    assert committer.catch_up(timeout_s=60)
    assert store.versions() == () and committer.tracker.incomplete == 1
    mailbox.post(rank1.to_json())
    assert committer.catch_up(timeout_s=60)
    (record,) = store.versions()
    assert (record.layer, record.step, [s.rank for s in record.shards]) == ("embed", 5, [0, 1])
    assert committer.log.committed == [("embed", 5)]
    lone = store.write_shard(shards("embed", 6)[1])
    mailbox.post(lone.to_json())
    assert committer.catch_up(timeout_s=60)
    assert committer.forget_incomplete() == 1 and len(store.versions()) == 1
    committer.close()


def sleep_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        threading.Event().wait()
    return rank


@pytest.mark.slow
def test_spawned_ranks_past_their_deadline_are_killed_and_named():
    with pytest.raises(RanksFailedError, match=r"sleepers: rank\(s\) \[.*\] of 2 still running after 5s; killed") as error:
        spawn_ranks(sleep_on_rank_1, 2, timeout_s=5, what="sleepers")
    assert 1 in error.value.ranks  # rank 0 may not have finished starting by then
