"""Snapshot hand-over: in order, each only once its copy has landed; the host path hands over at
once, the CUDA side-stream path never waits on the training stream (CUDA case behind
``LAYERCHECK_TEST_DEVICE=cuda``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from layercheck.policies.decision import PersistDecision, Reason
from layercheck.workers import loop
from layercheck.workers.drift.probe import LayerDrift
from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.shard import STATE_KEYS, LayerShard, ParamSlice
from layercheck.workers.snapshot_copy import CopyQueue, Handover, PendingSnapshot
from tests.support.devices import cuda_requested
from tests.support.layouts import one_layer_layout


class ScriptedCopy:
    """A copy that completes when the test says so (``torch.cuda.Event``'s two methods)."""

    def __init__(self) -> None:
        self.complete = False
        self.waited = False

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.waited = True
        self.complete = True


def _pending(step: int, done=None) -> PendingSnapshot:
    return PendingSnapshot(step=step, base=False, shards=[], done=done)


def test_queue_hands_over_in_order_and_only_what_has_landed():
    queue = CopyQueue(max_in_flight=3)
    first, second, third = ScriptedCopy(), ScriptedCopy(), ScriptedCopy()
    for step, done in ((1, first), (2, second), (3, third)):
        queue.push(_pending(step, done))
    assert queue.ready() == []
    second.complete = True  # a later copy done before an earlier one waits behind it
    assert queue.ready() == []
    first.complete = True
    assert [p.step for p in queue.ready()] == [1, 2]
    assert len(queue) == 1 and not third.waited
    assert [p.step for p in queue.ready(wait=True)] == [3] and third.waited
    queue.push(_pending(4))  # the host path: complete when pushed
    assert [p.step for p in queue.ready()] == [4]


def test_queue_waits_for_the_oldest_past_max_in_flight():
    queue = CopyQueue(max_in_flight=2)
    copies = [ScriptedCopy() for _ in range(3)]
    for step, done in enumerate(copies):
        queue.push(_pending(step, done))
    assert [p.step for p in queue.ready()] == [0]  # three outstanding > 2: the oldest is waited for
    assert copies[0].waited and not copies[1].waited
    with pytest.raises(ValueError, match="max_in_flight"):
        CopyQueue(max_in_flight=0)


class ScriptedCopier:
    def __init__(self) -> None:
        self.copies: list[ScriptedCopy] = []

    def copy(self, names, step, pool):
        shards = []
        for name in names:
            tensors = {key: pool.acquire(4).fill_(step) for key in STATE_KEYS}
            shards.append(
                LayerShard(
                    layer=name,
                    step=step,
                    rank=0,
                    world_size=1,
                    slices=(ParamSlice(name, (4,), 0, 4),),
                    tensors=tensors,
                    optimizer_step=step,
                )
            )
        self.copies.append(ScriptedCopy())
        return shards, self.copies[-1]

    def close(self) -> None:
        pass


def test_handover_persists_landed_snapshots_then_frees_their_buffers():
    pool = HostBufferPool(pin=False)
    copier = ScriptedCopier()
    handed: list[tuple[int, tuple[str, ...], bool, float]] = []

    def persist(shards, *, base):
        handed.append((shards[0].step, tuple(s.layer for s in shards), base, float(shards[0].tensors["fp32"][0])))

    handover = Handover(copier, persist, pool)
    handover.take(["a", "b"], 1, base=True)
    assert handed == [] and pool.lent == 6  # copying: not handed over, buffers held
    copier.copies[0].complete = True
    handover.take(["a"], 2, base=False)
    assert handed == [(1, ("a", "b"), True, 1.0)] and pool.lent == 3
    handover.flush(wait=True)
    assert handed[-1] == (2, ("a",), False, 2.0) and pool.lent == 0


def test_a_persist_that_keeps_plain_buffers_gets_them_for_good_and_the_pool_takes_new_ones():
    pool = HostBufferPool(pin=False)
    kept: list = []
    handover = Handover(ScriptedCopier(), lambda shards, *, base: kept.extend(shards), pool, give_away=True)
    handover.take(["a"], 1, base=False)
    handover.take(["a"], 2, base=False)
    handover.flush(wait=True)
    assert pool.lent == 0 and pool.allocated_bytes == 0  # nothing lent, nothing left in the pool
    assert [float(shard.tensors["fp32"][0]) for shard in kept] == [1.0, 2.0]  # step 2 took new buffers


def test_buffers_given_away_come_back_once_their_holder_is_done_and_the_next_snapshot_reuses_them():
    """The writer keeps what it is handed until written, then recycles it: the layer's next
    snapshot copies into the same buffers (no fresh allocation, no page faults on the training
    thread), and what is still held is never handed out twice."""
    pool = HostBufferPool(pin=False)
    kept: list = []
    handover = Handover(ScriptedCopier(), lambda shards, *, base: kept.extend(shards), pool, give_away=True)
    handover.take(["a"], 1, base=False)
    handover.flush(wait=True)
    (first,) = kept
    handover.take(["a"], 2, base=False)  # step 1 still held (not written): new buffers
    handover.flush(wait=True)
    second = kept[1]
    assert all(second.tensors[k] is not first.tensors[k] for k in STATE_KEYS)
    assert float(first.tensors["fp32"][0]) == 1.0  # the held snapshot is untouched
    pool.recycle(first)  # written
    assert pool.allocated_bytes == len(STATE_KEYS) * 4 * 4 and pool.lent == 0
    pool.recycle(first)  # twice: nothing more comes back
    pool.recycle(dataclasses.replace(first, tensors={k: torch.zeros(4) for k in STATE_KEYS}))  # not the pool's
    assert pool.allocated_bytes == len(STATE_KEYS) * 4 * 4
    handover.take(["a"], 3, base=False)
    handover.flush(wait=True)
    third = kept[2]
    assert {id(t) for t in third.tensors.values()} == {id(t) for t in first.tensors.values()}  # reused
    assert float(third.tensors["fp32"][0]) == 3.0 and pool.allocated_bytes == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not cuda_requested(), reason="CUDA case: set LAYERCHECK_TEST_DEVICE=cuda")
        ),
    ],
)
def test_snapshot_is_the_state_at_its_step_while_training_goes_on(device, monkeypatch):
    """A real engine (1 rank; NCCL on CUDA): a snapshot handed over after the next step has run
    still equals the state at the step it was taken, bit for bit."""
    from tests.support import worker_jobs
    from tests.support.dist_harness import run_ranks

    if device == "cuda" and not torch.cuda.is_available():
        pytest.fail("LAYERCHECK_TEST_DEVICE=cuda but no CUDA device")
    if device == "cpu":
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # on a GPU machine too: the spawned rank sees none
    (result,) = run_ranks(worker_jobs.snapshot_copy_job, 1)
    assert result["copier"] == ("SideStreamCopier" if device == "cuda" else "HostCopier")
    if device == "cpu":
        assert result["handed_before_next_step"]  # the host path hands over at once, as before
    assert result["layers"] and result["equal"] == {layer: True for layer in result["layers"]}
    assert result["changed_after"]  # the next step did move the weights the snapshot holds


def test_a_snapshot_handed_over_at_a_later_step_is_that_steps_stall(monkeypatch):
    """Where a copy lands after the step that took it (CUDA's side stream), the next step hands it
    over on the training thread (the coordinator copies it out of the buffers): the loop counts
    that as the step's stall, as it counts a hand-over at once (the host path)."""
    clock = [0.0]
    monkeypatch.setattr(loop.time, "monotonic", lambda: clock[0])
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.AdamW([param])
    layout = one_layer_layout(param, optimizer)

    class Coordinator:
        def __init__(self) -> None:
            self.handed: list[int] = []

        def report(self, drift, lr):
            return drift.step

        def decision(self, step):
            return PersistDecision.of(step, {"a": Reason.SCHEDULE}) if step == 1 else PersistDecision(step=step)

        def persist(self, shards, *, base):
            self.handed.append(shards[0].step)
            clock[0] += 0.25  # the copy out of the buffers

        def progress(self, progress):
            pass

    coordinator = Coordinator()
    protocol = loop.StepProtocol(layout, coordinator, rank=0)
    protocol._handover.copier = copier = ScriptedCopier()

    def step(t: int) -> float:
        return protocol.after_step(
            t, LayerDrift(step=t, l1={}, numel={}, measured=False), loss=1.0, lr=0.1, compute_s=0
        )

    assert step(1) == 0.0
    assert step(2) == 0.0 and coordinator.handed == []  # step 1's decision: copying, not landed
    copier.copies[0].complete = True
    assert step(3) == 0.25 and coordinator.handed == [2]
    assert protocol.result.stall_s == 0.25


def test_a_holder_may_hand_the_buffers_back_before_persist_returns():
    """A holder done with a shard at once (its copy off the training thread finished first)
    recycles it from inside ``persist``: the buffers are back in the pool, and the layer's next
    snapshot reuses them."""
    pool = HostBufferPool(pin=False)
    held: list = []

    def persist(shards, *, base):
        held.extend(shards)
        for shard in shards:
            pool.recycle(shard)

    handover = Handover(ScriptedCopier(), persist, pool, give_away=True)
    handover.take(["a"], 1, base=False)
    handover.flush(wait=True)
    assert pool.lent == 0 and pool.allocated_bytes == 3 * 4 * 4  # back in the pool, not given away for good
    handover.take(["a"], 2, base=False)
    handover.flush(wait=True)
    assert {id(t) for t in held[1].tensors.values()} == {id(t) for t in held[0].tensors.values()}


def test_rank_0s_progress_names_the_layers_it_handed_over_as_versions_of_that_step():
    """What storage owes the run starts at the hand-over: rank 0's progress of step ``t`` names the
    layers whose state after ``t`` it handed to its writer (step ``t - 1``'s decision carried out),
    which the supervisor counts as unwritten until they settle."""
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(4)
    optimizer.step()  # the moments a snapshot takes exist
    layout = one_layer_layout(param, optimizer)

    class Coordinator:
        def __init__(self) -> None:
            self.handed: list[int] = []
            self.progress_log: list = []

        def report(self, drift, lr):
            return drift.step

        def decision(self, step):
            return PersistDecision.of(step, {"a": Reason.SCHEDULE}) if step == 1 else PersistDecision(step=step)

        def persist(self, shards, *, base):
            self.handed.append(shards[0].step)

        def progress(self, progress):
            self.progress_log.append(progress)

    coordinator = Coordinator()
    protocol = loop.StepProtocol(layout, coordinator, rank=0)
    for t in (1, 2, 3):
        protocol.after_step(t, LayerDrift(step=t, l1={}, numel={}, measured=False), loss=1.0, lr=0.1, compute_s=0)
    assert coordinator.handed == [2]  # (a host copy: handed over at once)
    assert [(p.step, p.handed_over) for p in coordinator.progress_log] == [(1, ()), (2, ("a",)), (3, ())]
