"""A Ray rank's per-step calls (its drift report, rank 0's progress) leave from a sending thread
of its own, in the order the training thread made them (a submission is ~0.7 ms of CPU); a
measured step's answer is collected once its report has left, and ``flush`` (and a failed step,
``wait_sent``) waits until every call queued so far has. Driven with stand-in actor handles: Ray's ordering of one caller's calls to an
actor is Ray's own."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from layercheck.orchestrator.runtime import train_fn
from layercheck.orchestrator.runtime.ray_coordinator import RayCoordinator
from layercheck.workers.drift.probe import LayerDrift
from layercheck.workers.progress import StepProgress


class _Ref:
    """A call's object reference: its ``future()`` is the answer, in (``answered``) or never;
    ``futures`` records the threads that took one."""

    def __init__(self, value: dict, answered: bool) -> None:
        self.value, self.answered = value, answered
        self.futures: list[str] = []

    def future(self) -> Future:
        self.futures.append(threading.current_thread().name)
        future: Future = Future()
        if self.answered:
            future.set_result(self.value)
        return future


class _Method:
    def __init__(self, calls: list, name: str, gate: threading.Event, *, answers: bool = True) -> None:
        self.calls, self.name, self.gate, self.answers = calls, name, gate, answers
        self.refs: list[_Ref] = []

    def remote(self, *args):
        assert self.gate.wait(30), "the submission was made on the training thread"  # held until the test opens it
        step = args[0].step if isinstance(args[0], StepProgress) else args[0]
        self.calls.append((self.name, step, threading.current_thread().name))
        self.refs.append(_Ref({"step": step, "layers": {"embed": "schedule"}, "stop": False, "plan": []}, self.answers))
        return self.refs[-1]


class _Actor:
    def __init__(self, calls: list, method: str, gate: threading.Event, *, answers: bool = True) -> None:
        setattr(self, method, _Method(calls, method, gate, answers=answers))


def test_the_calls_leave_in_order_from_a_thread_of_their_own_and_flush_waits_for_them(monkeypatch):
    monkeypatch.setattr(train_fn.ray, "wait", lambda refs, **_: (refs, []))  # (flush) every answer is in
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


def test_a_measured_steps_answer_is_taken_as_a_future_as_the_report_leaves_and_a_quiet_steps_only_if_read():
    """A measured step's answer is read a step later: the sending thread takes its future as the
    report leaves (Ray completes it on its own thread). A quiet step's answer is read only where
    no plan holds its decision (right after a start): its future is taken then, on the training
    thread, and not at all where the plan answers (taking one costs the interpreter lock)."""
    gate = threading.Event()
    gate.set()
    policy = _Actor([], "report", gate)
    rank = RayCoordinator(rank=0, policy=policy, writer=None, supervisor=None, max_inflight_bytes=1)
    quiet = rank.report(LayerDrift(step=1, l1={}, numel={}, measured=False), 1e-3)
    measured = rank.report(LayerDrift(step=2, l1={"embed": 0.5}, numel={"embed": 4}, measured=True), 1e-3)
    assert rank.decision(quiet).names == ("embed",)  # no plan yet: the answer itself
    assert rank.decision(measured).names == ("embed",)
    first, second = policy.report.refs
    assert first.futures == [threading.current_thread().name]  # taken when read
    assert second.futures == ["layercheck-send-0_0"]  # taken as the report left


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
    waits = ray_coordinator.wait_for

    def wait_for(futures, timeout=None):
        polls.append(timeout)
        return waits(futures, timeout=timeout)

    monkeypatch.setattr(ray_coordinator, "wait_for", wait_for)
    monkeypatch.setattr(ray_coordinator, "RELEASE_POLL_S", 0.01)
    gate = threading.Event()
    gate.set()
    never = _Actor([], "report", gate, answers=False)
    rank = RayCoordinator(rank=0, policy=never, writer=None, supervisor=None, max_inflight_bytes=1)
    watcher = collective_abort.install(CollectiveAbort(backend="gloo"))
    try:
        watcher.arm()
        handle = rank.report(LayerDrift(step=5, l1={}, numel={}, measured=True), 1e-3)
        threading.Timer(0.2, collective_abort.request_abort, args=("Ray Train replaces rank(s) [1] in place",)).start()
        with pytest.raises(PeerLost, match="no decision for step 5.*rank\\(s\\) \\[1\\]") as lost:
            rank.decision(handle)
        assert lost_a_peer(lost.value) and len(polls) > 1
        collective_abort.install(None)  # never told
        rank.decision_timeout_s = 0.05
        with pytest.raises(TimeoutError, match="no decision for step 6"):
            rank.decision(rank.report(LayerDrift(step=6, l1={}, numel={}, measured=True), 1e-3))
    finally:
        collective_abort.install(None)


class _Store:
    """Stand-ins for ``ray.put``/``wait``/``get`` and a writer: a put off the training thread waits
    for ``gate``; a write is done unless named in ``unwritten``; a wait for storage returns at once."""

    def __init__(self, unwritten: set[str] = frozenset()) -> None:
        self.calls: list = []
        self.gate = threading.Event()
        self.unwritten = unwritten
        self.storage_waits: list = []
        store = self

        class Writer:
            class submit:  # noqa: N801 - an actor method's shape
                @staticmethod
                def remote(snapshot):
                    store.calls.append(("submit", snapshot, threading.current_thread().name))
                    return snapshot

            class hold:  # noqa: N801
                @staticmethod
                def remote(snapshot):
                    store.calls.append(("hold", snapshot, threading.current_thread().name))
                    return snapshot

        self.writer = Writer

    def install(self, monkeypatch) -> None:
        from layercheck.orchestrator.runtime import ray_coordinator

        monkeypatch.setattr(ray_coordinator.ray, "put", self.put)
        monkeypatch.setattr(ray_coordinator.ray, "wait", self.wait)
        monkeypatch.setattr(ray_coordinator.ray, "get", lambda ref, **_: 0)

    def put(self, wire):
        if threading.current_thread().name.startswith("layercheck-put"):
            assert self.gate.wait(30)
        self.calls.append(("put", f"{wire.layer}@{wire.step}", threading.current_thread().name))
        return f"{wire.layer}@{wire.step}"

    def wait(self, refs, num_returns=1, timeout=None, **_):
        if timeout is None:  # a wait for storage
            self.storage_waits += refs
            return refs, []
        return [r for r in refs if r not in self.unwritten], [r for r in refs if r in self.unwritten]


def _shard(layer: str, step: int):
    import torch

    from layercheck.workers.shard import STATE_KEYS, LayerShard, ParamSlice

    tensors = {key: torch.full((4,), float(step)) for key in STATE_KEYS}
    return LayerShard(layer, step, 0, 1, (ParamSlice(layer, (4,), 0, 4),), tensors, optimizer_step=step)


def test_a_snapshot_is_handed_over_off_the_training_thread_and_its_buffers_come_back(monkeypatch):
    """Where the loop lets the rank keep the snapshot's buffers (pinned ones too), ``persist``
    returns before the copy into the object store (a memcpy of the whole shard) and the writer's
    submission: the putting thread makes both, in order, and gives the buffers back once copied.
    Where the loop does not, both are made before ``persist`` returns, as the buffers are reused then."""
    store = _Store(unwritten={"embed@3", "lm_head@3"})
    store.install(monkeypatch)
    rank = RayCoordinator(rank=0, policy=None, writer=store.writer, supervisor=None, max_inflight_bytes=1 << 30)
    recycled: list = []
    assert rank.keep_host_buffers(lambda s: recycled.append(f"{s.layer}@{s.step}"), pinned=True)
    rank.persist([_shard("embed", 3), _shard("lm_head", 3)], base=False)
    assert store.calls == [] and recycled == []  # returned before the copy: the training thread went on
    store.gate.set()
    assert rank.wait_sent(10)
    putting = "layercheck-put-0_0"
    assert store.calls == [(c, f"{layer}@3", putting) for layer in ("embed", "lm_head") for c in ("put", "submit")]
    assert recycled == ["embed@3", "lm_head@3"]

    kept = RayCoordinator(rank=1, policy=None, writer=store.writer, supervisor=None, max_inflight_bytes=1 << 30)
    store.calls.clear()
    kept.persist([_shard("embed", 6)], base=False)  # not asked to keep the buffers: handed over before it returns
    training = threading.current_thread().name
    assert store.calls == [("put", "embed@6", training), ("submit", "embed@6", training)]


def test_the_in_flight_bound_counts_what_is_being_handed_over_and_not_what_was_written_meanwhile(monkeypatch):
    """Four snapshots handed over against a bound of three: the training thread waits for their
    hand-overs, then counts again. Three were written meanwhile, so it does not wait for storage; with
    two of them still unwritten, it waits for the oldest until the rest fit."""
    store = _Store(unwritten={"d@5"})
    store.install(monkeypatch)
    nbytes = _shard("a", 5).nbytes
    rank = RayCoordinator(rank=0, policy=None, writer=store.writer, supervisor=None, max_inflight_bytes=3 * nbytes)
    rank.keep_host_buffers(lambda s: None, pinned=True)
    threading.Timer(0.1, store.gate.set).start()
    rank.persist([_shard(x, 5) for x in "abcd"], base=False)
    assert rank.blocked_s > 0 and store.storage_waits == []  # waited for the hand-overs, not for storage
    store.unwritten = {"a@6", "b@6", "c@6", "d@6"}
    rank.persist([_shard(x, 6) for x in "abcd"], base=False)
    assert store.storage_waits == ["a@6"]  # the oldest: then three in flight, which fits


def test_a_survivors_capture_reaches_the_writer_after_the_snapshots_handed_over_before_it(monkeypatch):
    """A failed step hands over the snapshots already copied, then the capture: the capture waits
    for the putting thread, so the writer gets them in that order (the process may be killed next)."""
    store = _Store()
    store.install(monkeypatch)

    class Supervisor:
        class capture_began:  # noqa: N801
            remote = staticmethod(lambda *a: None)

        class capture_ended:  # noqa: N801
            remote = staticmethod(lambda *a: None)

    rank = RayCoordinator(
        rank=0, policy=None, writer=store.writer, supervisor=Supervisor, max_inflight_bytes=1 << 30, capture_timeout_s=5
    )
    rank.keep_host_buffers(lambda s: None, pinned=True)
    threading.Timer(0.2, store.gate.set).start()
    rank.persist([_shard("a", 7)], base=False)
    rank.capture([_shard("b", 8)], step=8, error=RuntimeError("a peer was lost"))
    assert [c[:2] for c in store.calls] == [("put", "a@7"), ("submit", "a@7"), ("put", "b@8"), ("hold", "b@8")]


def test_flush_keeps_to_its_timeout_while_a_snapshot_is_still_being_handed_over(monkeypatch):
    store = _Store()
    store.install(monkeypatch)
    rank = RayCoordinator(rank=0, policy=None, writer=store.writer, supervisor=None, max_inflight_bytes=1 << 30)
    rank.keep_host_buffers(lambda s: None, pinned=False)
    rank.persist([_shard("a", 7)], base=False)
    flushing = threading.Thread(target=rank.flush, kwargs={"timeout_s": 0.2}, daemon=True)
    flushing.start()
    flushing.join(10)
    stuck = flushing.is_alive()
    store.gate.set()
    assert not stuck
    assert rank.wait_sent(10) and ("submit", "a@7", "layercheck-put-0_0") in store.calls


def test_a_failed_put_gives_every_buffer_of_its_hand_over_back_and_fails_the_next_persist(monkeypatch):
    """A put that raises on the putting thread (the object store full, say): the shards after it are
    not handed over, and none of the hand-over's buffers stays given away (the loop's pool would
    allocate new ones for good); the error reaches the training thread at its next ``persist``."""
    import pytest

    store = _Store()
    store.install(monkeypatch)

    def put(wire):
        assert store.gate.wait(30)  # (opened once the first persist returned)
        if wire.layer == "b":
            raise MemoryError("object store full")
        return f"{wire.layer}@{wire.step}"

    from layercheck.orchestrator.runtime import ray_coordinator

    monkeypatch.setattr(ray_coordinator.ray, "put", put)
    rank = RayCoordinator(rank=0, policy=None, writer=store.writer, supervisor=None, max_inflight_bytes=1 << 30)
    recycled: list = []
    rank.keep_host_buffers(lambda s: recycled.append(s.layer), pinned=False)
    rank.persist([_shard(x, 4) for x in "abc"], base=False)
    store.gate.set()
    assert rank.wait_sent(10)
    assert sorted(recycled) == ["a", "b", "c"] and [c[1] for c in store.calls if c[0] == "submit"] == ["a@4"]
    with pytest.raises(MemoryError, match="object store full"):
        rank.persist([_shard("d", 5)], base=False)
    assert rank.wait_sent(10)  # (d's hand-over, queued before the error was raised, is done with the stand-ins)
