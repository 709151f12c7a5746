"""The controller-side callback of an in-place run (``orchestrator/runtime/in_place.py``), on stand-ins
for Ray Train's worker group: as a lost worker's replica group is shut down, the supervisor hears
which ranks are replaced (a spare is promoted) and every other worker is asked to release itself
from a collective blocked on them, without the controller waiting for the answers."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from layercheck.orchestrator.runtime import in_place
from layercheck.workers import collective_abort
from layercheck.workers.collective_abort import AbortDecision


@dataclass
class _Context:
    world_rank: int


class _Worker:
    def __init__(self, rank: int) -> None:
        self.distributed_context = _Context(rank)
        self.asked: list[str] = []

    def execute_async(self, fn, reason):
        self.asked.append(reason)
        return fn(reason)  # the answer itself stands in for its reference (ray.get is the identity below)


class _Group:
    def __init__(self, workers) -> None:
        self.workers = workers

    def get_workers(self):
        return self.workers


class _Supervisor:
    def __init__(self, spares: tuple[int, ...] = ()) -> None:
        self.replaced: list[list[int]] = []
        outer = self

        class _Method:
            def remote(self, ranks):
                outer.replaced.append(ranks)
                return [r for r in ranks if r not in spares]  # those that trained

        self.replacing = _Method()


def test_a_replaced_worker_promotes_a_spare_and_every_other_worker_is_asked_to_release(monkeypatch):
    monkeypatch.setattr(in_place.ray, "get", lambda value, timeout=None: value)
    # no watcher in this process, whatever an earlier test in it installed and ended
    monkeypatch.setattr(collective_abort, "_installed", None)
    monkeypatch.setattr(collective_abort, "_ended_after_raise", False)
    logged = threading.Event()
    answers: dict = {}

    def log(asked, lost):
        answers.update(asked)
        logged.set()

    monkeypatch.setattr(in_place, "_log_answers", log)
    workers = [_Worker(r) for r in range(3)]
    supervisor = _Supervisor()
    callback = in_place.ReplaceInPlace(supervisor)
    callback.after_worker_group_start(_Group(workers))
    callback.before_replica_group_shutdown(_Group([workers[1]]))
    assert supervisor.replaced == [[1]]
    assert [bool(w.asked) for w in workers] == [True, False, True]
    assert "rank(s) [1]" in workers[0].asked[0]
    assert logged.wait(10)
    # in this process no training thread is watched: nothing to release (a gloo survivor says not_needed)
    assert answers == {0: AbortDecision.NO_WATCHER.value, 2: AbortDecision.NO_WATCHER.value}


def test_a_lost_spare_releases_nobody(monkeypatch):
    """A spare trains with nobody: its loss must not release (on NCCL: abort) the training ranks."""
    monkeypatch.setattr(in_place.ray, "get", lambda value, timeout=None: value)
    monkeypatch.setattr(in_place, "_log_answers", lambda asked, lost: None)
    workers = [_Worker(r) for r in range(3)]
    supervisor = _Supervisor(spares=(2,))
    callback = in_place.ReplaceInPlace(supervisor)
    callback.after_worker_group_start(_Group(workers))
    callback.before_replica_group_shutdown(_Group([workers[2]]))
    assert supervisor.replaced == [[2]]
    assert [w.asked for w in workers] == [[], [], []]


def _worker_group_error(failures: dict[int, Exception]):
    from ray.train.v2.api.exceptions import WorkerGroupError

    return WorkerGroupError("workers failed", failures)


def test_survivors_that_leave_in_place_recovery_are_replaced_without_a_charge_to_max_failures():
    """A death is charged once, as a full restart charges it: the survivors that then leave in-place
    recovery (their recovery failed, or in place is off) are replaced for free, at most one leave
    per worker between charged failures (so a loop of leaves still ends); any other error is Ray
    Train's own decision."""
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision

    policy = in_place.SparingFailurePolicy(DefaultFailurePolicy(FailureConfig(max_failures=1)), num_workers=2)
    death = _worker_group_error({1: RuntimeError("the actor died unexpectedly")})
    left = _worker_group_error({0: in_place.LeftInPlaceRecovery("rank 0's recovery in its own process failed")})
    assert policy.make_decision(death) == FailureDecision.RETRY  # charged: 1 of 1
    assert policy.make_decision(left) == FailureDecision.RETRY
    assert policy.make_decision(left) == FailureDecision.RETRY
    assert policy.make_decision(left) == FailureDecision.RAISE, "a third leave for 2 workers is charged"

    policy = in_place.SparingFailurePolicy(DefaultFailurePolicy(FailureConfig(max_failures=1)), num_workers=2)
    mixed = _worker_group_error({0: in_place.LeftInPlaceRecovery("left"), 1: RuntimeError("died")})
    assert policy.make_decision(mixed) == FailureDecision.RETRY  # charged: a death among the leaves
    assert policy.make_decision(death) == FailureDecision.RAISE


def test_a_survivor_recovers_in_place_only_while_no_recovery_in_place_has_failed(monkeypatch):
    """What a rank of an in-place run does with its incarnation's error, and what it tells the
    supervisor: a lost peer, in place on → recover in this process; a failed recovery → leave
    (charged to nothing); a lost peer once in place is off → leave; its own step's error → raise
    it (charged)."""
    import pytest

    told: list[tuple[int, str, str]] = []
    off: list[str | None] = [None]
    monkeypatch.setattr(in_place, "_leave", lambda name, rank, reason, detail: told.append((rank, reason, detail)))
    monkeypatch.setattr(in_place, "_in_place_off", lambda name: off[0])
    peer_lost = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")

    assert in_place.recovers_in_place("sup", 0, peer_lost, recovering=False) and told == []
    with pytest.raises(in_place.LeftInPlaceRecovery, match="rank 0's recovery in its own process failed: OSError: x"):
        in_place.recovers_in_place("sup", 0, OSError("x"), recovering=True)
    assert told[-1] == (0, "recovery_failed", "OSError: x")
    off[0] = "rank 0: OSError: x"
    with pytest.raises(in_place.LeftInPlaceRecovery, match="in-place recovery is off since rank 0: OSError: x"):
        in_place.recovers_in_place("sup", 1, peer_lost, recovering=True)
    assert told[-1] == (1, "in_place_off", "off since rank 0: OSError: x")
    assert not in_place.recovers_in_place("sup", 1, ValueError("bad batch"), recovering=False)
    assert told[-1] == (1, "rank_failed", "ValueError: bad batch")
