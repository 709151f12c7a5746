"""The local runtime's writer, receipt pump and writers port, in one process: a newer snapshot of
a layer supersedes an unwritten one, the byte bound makes the trainer wait, receipts travel
through the in-memory mailbox to the run's :class:`RunSupervisor`, which commits a version only
once every rank's shard is in, and a drain names the ranks whose writer did not finish. A store
hook holds the writer inside a write, so every interleaving here is scripted, not timed."""

from __future__ import annotations

import math
import threading

import pytest
import torch.distributed as dist

from layercheck.orchestrator.core.run_status import LayerFigures
from layercheck.orchestrator.core.run_supervisor import RunSupervisor
from layercheck.orchestrator.local.mailbox import Mailbox
from layercheck.orchestrator.local.receipts import ReceiptPump
from layercheck.orchestrator.local.spawn import RanksFailedError, spawn_ranks
from layercheck.orchestrator.local.writer import LocalWriter
from layercheck.orchestrator.local.writers_port import LocalWriters
from layercheck.orchestrator.store.layer_store import LayerStore
from tests.support.store_helpers import PARAMS, cut_shards, even_cuts, layer_state

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


def test_every_version_handed_over_is_written_and_the_byte_bound_waits(tmp_path, mailbox):
    """No shard of another step is dropped (a rank that dropped one would keep a step its peers
    did not: the PersistGate bounds versions per layer instead); past the byte bound, submit waits."""
    gate = Gate()
    store = LayerStore.open(str(tmp_path), fsync=False, hook=gate)
    one = shards("block.0", 1)[0]
    writer = LocalWriter(store, mailbox, max_inflight_bytes=3 * one.nbytes)
    writer.submit(one, base=False)
    assert gate.entered.wait(timeout=60)  # the writer is inside step 1's write
    writer.submit(shards("block.1", 2)[0], base=False)
    writer.submit(shards("block.1", 3)[0], base=False)  # queued behind step 2, which stays
    assert writer.stats.superseded == 0 and writer.inflight_bytes == 3 * one.nbytes
    blocked = threading.Thread(target=writer.submit, args=(shards("block.0", 4)[0],), kwargs={"base": False})
    blocked.start()  # 4 shards' bytes in flight > the bound of 3: waits for storage
    blocked.join(timeout=0.5)
    assert blocked.is_alive()
    gate.release.set()
    blocked.join(timeout=60)
    assert not blocked.is_alive() and writer.stats.blocked_s > 0
    assert writer.drain(timeout_s=60)
    writer.close()
    taken = [mailbox.take()["receipt"] for _ in range(4)]
    assert sorted((r["layer"], r["step"]) for r in taken) == [
        ("block.0", 1),
        ("block.0", 4),
        ("block.1", 2),
        ("block.1", 3),
    ]
    assert mailbox.posted() == 4


def test_once_the_steps_ended_the_final_save_does_not_wait_for_storage(tmp_path, mailbox):
    """The final save comes after the last step: past the byte bound it is queued, not waited on
    (``StepProtocol.finish`` calls the coordinator's ``steps_ended`` first); the end's drain
    waits for its writes instead."""
    gate = Gate()
    store = LayerStore.open(str(tmp_path), fsync=False, hook=gate)
    one = shards("block.0", 1)[0]
    writer = LocalWriter(store, mailbox, max_inflight_bytes=one.nbytes)
    writer.submit(one, base=False)
    assert gate.entered.wait(timeout=60)  # the writer is stuck inside step 1's write
    writer.unbounded = True  # what LocalCoordinator.steps_ended sets
    writer.submit(shards("block.1", 1)[0], base=False)  # 2 shards in flight > the bound of 1
    assert writer.stats.blocked_s == 0 and writer.inflight_bytes == 2 * one.nbytes
    gate.release.set()
    assert writer.drain(timeout_s=60)
    writer.close()
    assert mailbox.posted() == 2


def test_a_memory_version_waits_for_no_queued_write_and_replaces_its_waiting_predecessor(tmp_path, mailbox):
    """Behind a stuck write (slow storage), a layer's memory versions do not pile up: each replaces
    the one still waiting, goes ahead of the scheduled writes queued, and never waits on the bound.
    Each shard is handed back (``recycle``: its buffers to the loop's pool) once superseded or
    written, and only then."""
    gate = Gate()
    store = LayerStore.open(str(tmp_path), fsync=False, hook=gate)
    writer = LocalWriter(store, mailbox, max_inflight_bytes=2 * shards("block.0", 1)[0].nbytes, memory_bytes=2**20)
    recycled: list[tuple[str, int]] = []
    writer.recycle = lambda shard: recycled.append((shard.layer, shard.step))
    writer.submit(shards("block.0", 1)[0], base=False)
    assert gate.entered.wait(timeout=60)  # stuck inside step 1's write
    writer.submit(shards("block.1", 2)[0], base=False)  # a scheduled write, queued
    for step in (2, 3, 4):
        writer.submit(shards("block.0", step)[0], base=False, origin="memory")
    assert writer.stats.superseded == 2 and writer.stats.blocked_s == 0 and len(writer._queue) == 2
    assert recycled == [("block.0", 2), ("block.0", 3)]  # the superseded ones; nothing written yet
    gate.release.set()
    assert writer.drain(timeout_s=60)
    writer.close()
    assert recycled[2:] == [("block.0", 1), ("block.0", 4), ("block.1", 2)]  # each once, as written
    taken = [mailbox.take()["receipt"] for _ in range(3)]
    assert [(r["layer"], r["step"], r["origin"]) for r in taken] == [
        ("block.0", 1, "policy"),
        ("block.0", 4, "memory"),  # ahead of the queued write, the newest only
        ("block.1", 2, "policy"),
    ]
    assert not list((tmp_path / "layers" / "block.0").glob("0000000004*"))  # held, never written
    assert writer.memory_stats().held_shards == 3  # the two written shards and block.0's memory version


def test_a_capture_is_written_next_and_never_supersedes_the_same_step_scheduled_shard(tmp_path, mailbox):
    gate = Gate()
    store = LayerStore.open(str(tmp_path), fsync=False, hook=gate)
    writer = LocalWriter(store, mailbox, max_inflight_bytes=2**30)
    writer.submit(shards("block.0", 1)[0], base=False)
    assert gate.entered.wait(timeout=60)  # the writer is inside step 1's write
    writer.submit(shards("block.1", 2)[0], base=False)
    writer.submit(shards("block.1", 3)[0], base=False)
    writer.submit(shards("block.1", 3)[0], base=False, origin="capture")  # the survivor's, same step
    gate.release.set()
    assert writer.drain(timeout_s=60)
    writer.close()
    taken = [mailbox.take()["receipt"] for _ in range(4)]
    assert [(r["layer"], r["step"], r["origin"]) for r in taken] == [
        ("block.0", 1, "policy"),
        ("block.1", 3, "capture"),  # ahead of what was queued before it
        ("block.1", 2, "policy"),
        ("block.1", 3, "policy"),
    ]
    assert writer.stats.superseded == 0 and 0 < writer.stats.capture_bytes < writer.stats.written_bytes


class NoPolicy:
    def last_complete_step(self) -> int:
        return 0

    def restart(self, **kwargs) -> None:
        pass


class NoWriters:
    def drain(self, deadline_s):
        return ()

    def replace(self, names) -> None:
        pass


def test_a_version_is_committed_only_once_every_rank_shard_is_in(tmp_path, mailbox):
    store = LayerStore.open(str(tmp_path), fsync=False)
    run = RunSupervisor(run_id="t", store=store, layer_numel={"embed": TOTAL}, policy=NoPolicy(), writers=NoWriters())
    pump = ReceiptPump(mailbox, run)
    rank0, rank1 = (store.write_shard(s) for s in shards("embed", 5))
    mailbox.post(rank0.to_json(), 0.5)
    assert pump.catch_up(timeout_s=60)
    assert store.versions() == () and run.commits.tracker.incomplete == 1
    mailbox.post(rank1.to_json(), 0.25)
    assert pump.catch_up(timeout_s=60)
    (record,) = store.versions()
    assert (record.layer, record.step, [s.rank for s in record.shards]) == ("embed", 5, [0, 1])
    mailbox.post_failure("writing embed step 6 rank 0 failed: disk full", layer="embed", step=6)
    assert pump.catch_up(timeout_s=60)
    status = run.status()
    assert status.layers["embed"] == LayerFigures(versions=1, bytes=record.nbytes, last_step=5)
    assert status.write_latencies == [0.5, 0.25] and status.write_failures == 1
    pump.close()


def test_a_drain_names_the_ranks_whose_writer_did_not_finish(tmp_path, mailbox):
    store = LayerStore.open(str(tmp_path), fsync=False)
    writer = LocalWriter(store, mailbox, max_inflight_bytes=2**20)
    port = LocalWriters(own=lambda: writer, mailbox=mailbox, catch_up=lambda timeout_s: True, world_size=3)
    port.begin(1)
    mailbox.say_drained(1, 1, True)
    mailbox.say_drained(1, 2, False)  # rank 2's writer ran out of time
    assert port.drain(deadline_s=30) == ("writer-rank2",)
    port.begin(2)
    for rank in (1, 2):
        mailbox.say_drained(2, rank, True)
    assert port.drain(deadline_s=30) == ()
    port2 = LocalWriters(own=lambda: writer, mailbox=mailbox, catch_up=lambda timeout_s: False, world_size=1)
    port2.begin(3)
    assert port2.drain(deadline_s=30) == ("receipts",)  # the commits of what was written are behind
    writer.close()


def sleep_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        threading.Event().wait()
    return rank


@pytest.mark.slow
def test_spawned_ranks_past_their_deadline_are_killed_and_named():
    with pytest.raises(
        RanksFailedError, match=r"sleepers: rank\(s\) \[.*\] of 2 still running after 5s; killed"
    ) as error:
        spawn_ranks(sleep_on_rank_1, 2, timeout_s=5, what="sleepers")
    assert 1 in error.value.ranks  # rank 0 may not have finished starting by then
