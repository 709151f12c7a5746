"""A rank's waits for storage: every wait counted, the warning rate-limited (a run whose storage
is slower than its schedule waits at every save, several times a second on a large model)."""

import logging

from layercheck.orchestrator.core.persistence.storage_waits import StorageWaits
from tests.support.clock import ManualClock


def wait(waits: StorageWaits, clock: ManualClock, seconds: float, inflight: int = 700) -> None:
    started = waits.begin(0, inflight, 512)
    clock.now += seconds
    waits.end(started)


def test_the_first_wait_is_said_with_its_remedy_then_at_most_once_a_period_with_what_the_waits_added_up_to(caplog):
    clock = ManualClock(100.0)
    waits = StorageWaits(every_s=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="layercheck.orchestrator.core.persistence.storage_waits"):
        wait(waits, clock, 0.5)
        for _ in range(99):  # 0.25 s apart, 0.25 s each: the next 49.5 s of the run
            clock.now += 0.25
            wait(waits, clock, 0.25)
        assert len(caplog.records) == 1
        first = caplog.records[0].getMessage()
        assert "rank 0: 700 snapshot bytes in flight > 512: waiting for storage" in first
        assert "persistence.max_inflight_bytes" in first and "at most every 60 s" in first
        assert "policy.spread_phases = true" in first  # what spreads a burst of saves
        clock.now += 11.0  # 61 s after the first warning
        wait(waits, clock, 1.0, inflight=900)
    assert len(caplog.records) == 2
    # the 100 waits that ended since the first warning: 0.5 s + 99 x 0.25 s
    assert caplog.records[1].getMessage() == (
        "rank 0: still waiting for storage: 100 wait(s), 25.2 s in all, over the last 61 s "
        "(900 snapshot bytes in flight now > 512)"
    )
    assert waits.waits == 101 and abs(waits.blocked_s - (0.5 + 99 * 0.25 + 1.0)) < 1e-9
