"""The controller-side callback of an in-place run (``orchestrator/runtime/in_place.py``), on stand-ins
for Ray Train's worker group: as a lost worker's replica group is shut down, the supervisor hears
which ranks are replaced (a spare is promoted) and every other worker is asked to release itself
from a collective blocked on them, without the controller waiting for the answers."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from layercheck.orchestrator.runtime import in_place
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
    def __init__(self) -> None:
        self.replaced: list[list[int]] = []
        outer = self

        class _Method:
            def remote(self, ranks):
                outer.replaced.append(ranks)

        self.replacing = _Method()


def test_a_replaced_worker_promotes_a_spare_and_every_other_worker_is_asked_to_release(monkeypatch):
    monkeypatch.setattr(in_place.ray, "get", lambda value, timeout=None: value)
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
