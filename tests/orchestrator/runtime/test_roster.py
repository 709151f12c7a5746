"""The warm spares' roster (``layercheck.orchestrator.core.recovery.roster``): which Ray Train worker trains
which rank and which waits, through replacements, promotions and the run's end."""

import pytest

from layercheck.orchestrator.core.recovery.roster import END, SPARE, TRAIN, Role, Roster


def test_the_first_workers_train_their_own_ranks_and_the_rest_wait_as_spares():
    roster = Roster(world_size=2, spares=1)
    assert roster.role(0) == Role(TRAIN, 0, 2) and roster.role(1) == Role(TRAIN, 1, 2)
    assert roster.role(2) == Role(SPARE, world_size=2)
    roster.ready(2)
    assert roster.take(2) is None  # nothing asked of it yet


def test_a_replaced_workers_rank_goes_to_the_waiting_spare_and_its_replacement_becomes_a_spare():
    roster = Roster(world_size=2, spares=1)
    roster.ready(2)
    assert roster.replacing(1) == 2  # rank 1's worker is replaced: the spare at world rank 2 takes rank 1
    assert roster.take(2) == Role(TRAIN, 1, 2)
    assert roster.take(2) is None  # told once
    assert roster.role(1) == Role(SPARE, world_size=2)  # the replacement at world rank 1 is the next spare
    assert roster.promotions == 1
    roster.ready(1)
    assert roster.replacing(2) == 1  # the promoted spare dies too: the next spare takes rank 1 again
    assert roster.take(1) == Role(TRAIN, 1, 2) and roster.role(2) == Role(SPARE, world_size=2)


def test_without_a_spare_ready_the_replacement_trains_the_rank_cold():
    roster = Roster(world_size=2, spares=1)  # the spare is still warming up
    assert roster.replacing(0) is None
    assert roster.role(0) == Role(TRAIN, 0, 2)
    roster.ready(2)
    assert roster.replacing(0) == 2  # ready now: the next loss of rank 0 promotes it


def test_a_lost_spare_is_no_longer_waiting_and_its_replacement_is_a_spare():
    roster = Roster(world_size=1, spares=2)
    roster.ready(1)
    roster.ready(2)
    assert roster.replacing(1) is None  # a spare lost: no rank to take over
    assert roster.waiting == [2] and roster.role(1) == Role(SPARE, world_size=1)
    assert roster.replacing(0) == 2


def test_a_promotion_to_a_spare_that_died_before_taking_it_goes_to_its_replacement():
    roster = Roster(world_size=2, spares=1)
    roster.ready(2)
    assert roster.replacing(0) == 2
    # the spare at world rank 2 dies before it took the promotion; its replacement trains rank 0
    assert roster.role(2) == Role(TRAIN, 0, 2) and roster.take(2) is None


def test_once_every_rank_has_finished_the_spares_and_late_workers_end():
    roster = Roster(world_size=2, spares=1)
    roster.ready(2)
    roster.finish(0)
    assert roster.take(2) is None
    roster.finish(1)
    assert roster.take(2) == Role(END, world_size=2) and roster.role(1) == Role(END, world_size=2)
    assert roster.replacing(1) is None, "Ray Train's teardown at the end promotes nobody"


def test_a_worker_outside_the_group_is_refused():
    with pytest.raises(ValueError, match="not in a group of 3"):
        Roster(world_size=2, spares=1).role(3)
    with pytest.raises(ValueError, match="1 spares"):
        Roster(world_size=0, spares=1)


def test_a_waiting_spare_wakes_when_it_is_promoted_and_times_out_otherwise():
    import threading

    from layercheck.orchestrator.runtime.spares import SpareRoster

    spares = SpareRoster(world_size=2, spares=1)
    assert spares.wait(2, timeout_s=0.01) == Role(SPARE, world_size=2)  # nothing came: ask again
    answer: list[Role] = []
    waiter = threading.Thread(target=lambda: answer.append(spares.wait(2, timeout_s=30)))
    waiter.start()
    assert spares.replacing([1]) == [(2, 1)]
    waiter.join(timeout=30)
    assert answer == [Role(TRAIN, 1, 2)]
    assert spares.view() == {"spares": 1, "waiting": 0, "promotions": 1}


def test_a_spare_is_promotable_once_its_model_is_built_and_warms_up_after(monkeypatch):
    """``wait_as_spare``: the roster may promote a spare as soon as its model is built; its warm-up
    (the engine's imports) comes after, so a failure during the warm-up still finds a spare (the
    promotion waits for the warm-up's end, no longer than a cold start would spend on it)."""
    from layercheck.orchestrator.runtime import spares

    roster = spares.SpareRoster(world_size=2, spares=1)

    class _Call:
        def __init__(self, fn):
            self.remote = fn

    supervisor = type("Supervisor", (), {"spare_wait": _Call(roster.wait)})()
    monkeypatch.setattr(spares.ray, "get", lambda value: value)
    assert roster.role(2) == Role(SPARE, world_size=2)
    warmed: list[bool] = []

    def warm() -> None:  # rank 1's worker is lost while the spare warms up
        assert roster.replacing([1]) == [(2, 1)], "the spare was not promotable before its warm-up"
        warmed.append(True)

    role, built = spares.wait_as_spare(supervisor, 2, lambda: "model", warm)
    assert (role, built, warmed) == (Role(TRAIN, 1, 2), "model", [True])
