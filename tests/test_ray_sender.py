"""A Ray rank's per-step calls (its drift report, rank 0's progress) leave from a sending thread
of its own, in the order the training thread made them (a submission is ~0.7 ms of CPU); a
measured step's answer is collected once its report has left, and ``flush`` (and a failed step,
``wait_sent``) waits until every call queued so far has. Driven with stand-in actor handles: Ray's ordering of one caller's calls to an
actor is Ray's own."""

from __future__ import annotations

import threading

from layercheck.orchestrator.runtime import train_fn
from layercheck.orchestrator.runtime.ray_coordinator import RayCoordinator
from layercheck.workers.drift import LayerDrift
from layercheck.workers.progress import StepProgress


class _Method:
    def __init__(self, calls: list, name: str, gate: threading.Event) -> None:
        self.calls, self.name, self.gate = calls, name, gate

    def remote(self, *args):
        assert self.gate.wait(30), "the submission was made on the training thread"  # held until the test opens it
        step = args[0].step if isinstance(args[0], StepProgress) else args[0]
        self.calls.append((self.name, step, threading.current_thread().name))
        return {"step": step, "layers": {"embed": "schedule"}, "stop": False, "plan": []}


class _Actor:
    def __init__(self, calls: list, method: str, gate: threading.Event) -> None:
        setattr(self, method, _Method(calls, method, gate))


def test_the_calls_leave_in_order_from_a_thread_of_their_own_and_flush_waits_for_them(monkeypatch):
    monkeypatch.setattr(train_fn.ray, "get", lambda answer: answer)  # the stand-in answers at once
    monkeypatch.setattr(train_fn.ray, "wait", lambda refs, **_: (refs, []))
    calls: list = []
    gate = threading.Event()  # submissions wait until it opens
    rank = RayCoordinator(
        rank=0,
        policy=_Actor(calls, "report", gate),
        writer=None,
        supervisor=_Actor(calls, "progress", gate),
        max_inflight_bytes=1,
    )
    handles = []
    for step in (1, 2, 3):
        handles.append(rank.report(LayerDrift(step=step, l1={}, numel={}, measured=True), 1e-3))
        rank.progress(StepProgress(step=step, loss=1.0, lr=1e-3, compute_s=0.1, stall_s=0.0))
    assert not calls  # queued: the training thread went on without making them
    assert not rank.wait_sent(0.05)  # (what a failed step waits for, bounded: StepProtocol.on_failure)
    gate.set()
    assert rank.decision(handles[0]).names == ("embed",)  # collected once its report left
    rank.flush(timeout_s=10)
    assert rank.wait_sent(10)
    assert [(name, step) for name, step, _ in calls] == [
        (name, step) for step in (1, 2, 3) for name in ("report", "progress")
    ]
    assert {thread for _, _, thread in calls} == {"layercheck-send-0_0"}


def test_a_rank_waiting_for_a_decision_that_a_lost_peer_never_reported_is_released(monkeypatch):
    """The policy answers a step once every rank reported it; a peer that died before its report
    left leaves that answer pending for good, and this rank outside any collective. Told of the
    loss (by Ray Train's controller, through the installed watcher), the wait raises PeerLost,
    what a survivor's step raises, so it recovers; never told, it gives up after a bound."""
    import pytest

    from layercheck.orchestrator.runtime import ray_coordinator
    from layercheck.orchestrator.runtime.in_place import lost_a_peer
    from layercheck.workers import collective_abort
    from layercheck.workers.collective_abort import CollectiveAbort, PeerLost

    polls: list[float] = []

    def never(refs, timeout=None, **_):
        polls.append(timeout)
        return [], refs

    monkeypatch.setattr(ray_coordinator.ray, "wait", never)
    monkeypatch.setattr(ray_coordinator, "RELEASE_POLL_S", 0.01)
    gate = threading.Event()
    gate.set()
    rank = RayCoordinator(rank=0, policy=_Actor([], "report", gate), writer=None, supervisor=None, max_inflight_bytes=1)
    watcher = collective_abort.install(CollectiveAbort(backend="gloo"))
    try:
        watcher.arm()
        handle = rank.report(LayerDrift(step=5, l1={}, numel={}, measured=True), 1e-3)
        threading.Timer(0.2, collective_abort.request_abort, args=("Ray Train replaces rank(s) [1] in place",)).start()
        with pytest.raises(PeerLost, match="no decision for step 5.*rank\\(s\\) \\[1\\]") as lost:
            rank.decision(handle)
        assert lost_a_peer(lost.value) and len(polls) > 1
        collective_abort.install(None)  # never told
        monkeypatch.setattr(ray_coordinator, "DECISION_TIMEOUT_S", 0.05)
        with pytest.raises(TimeoutError, match="no decision for step 6"):
            rank.decision(rank.report(LayerDrift(step=6, l1={}, numel={}, measured=True), 1e-3))
    finally:
        collective_abort.install(None)


def test_a_snapshot_is_handed_over_off_the_training_thread_and_its_buffers_come_back(monkeypatch):
    """Where the loop lets the rank keep the snapshot's buffers (pinned ones too), ``persist``
    returns before the copy into the object store (a memcpy of the whole shard) and the writer's
    submission: the putting thread makes both, in order, and gives the buffers back once copied.
    The in-flight bound counts what it has not handed over yet. Where the loop does not, both are
    made before ``persist`` returns, as the buffers are reused then."""
    import torch

    from layercheck.orchestrator.runtime import ray_coordinator
    from layercheck.workers.shard import STATE_KEYS, LayerShard, ParamSlice

    calls: list = []
    gate = threading.Event()

    def put(wire):
        assert gate.wait(30)
        calls.append(("put", f"{wire.layer}@{wire.step}", threading.current_thread().name))
        return f"{wire.layer}@{wire.step}"

    class Writer:
        class submit:  # noqa: N801 - an actor method's shape
            @staticmethod
            def remote(snapshot):
                calls.append(("submit", snapshot, threading.current_thread().name))
                return snapshot

    monkeypatch.setattr(ray_coordinator.ray, "put", put)
    monkeypatch.setattr(ray_coordinator.ray, "wait", lambda refs, **_: ([], refs))  # nothing written yet

    def shard(layer: str, step: int) -> LayerShard:
        tensors = {key: torch.full((4,), float(step)) for key in STATE_KEYS}
        return LayerShard(layer, step, 0, 1, (ParamSlice(layer, (4,), 0, 4),), tensors, optimizer_step=step)

    nbytes = shard("embed", 1).nbytes
    rank = RayCoordinator(rank=0, policy=None, writer=Writer, supervisor=None, max_inflight_bytes=3 * nbytes)
    recycled: list = []
    assert rank.keep_host_buffers(lambda s: recycled.append(f"{s.layer}@{s.step}"), pinned=True)
    rank.persist([shard("embed", 3), shard("lm_head", 3)], base=False)
    assert calls == [] and recycled == []  # returned before the copy: the training thread went on
    gate.set()
    assert rank.wait_sent(10)
    putting = "layercheck-put-0_0"
    assert calls == [(call, f"{layer}@3", putting) for layer in ("embed", "lm_head") for call in ("put", "submit")]
    assert recycled == ["embed@3", "lm_head@3"]

    gate.clear()  # two more being handed over: four snapshots in flight > 3, so the training thread waits
    calls.clear()
    threading.Timer(0.2, gate.set).start()
    rank.persist([shard("embed", 4), shard("norm", 4)], base=False)
    assert [c[:2] for c in calls] == [
        ("put", "embed@4"),
        ("submit", "embed@4"),
        ("put", "norm@4"),
        ("submit", "norm@4"),
    ]
    assert rank.blocked_s > 0  # (it waited for the hand-overs, then for storage)

    kept = RayCoordinator(rank=1, policy=None, writer=Writer, supervisor=None, max_inflight_bytes=1 << 30)
    calls.clear()
    kept.persist([shard("embed", 6)], base=False)  # not asked to keep the buffers: handed over before it returns
    training = threading.current_thread().name
    assert calls == [("put", "embed@6", training), ("submit", "embed@6", training)]
