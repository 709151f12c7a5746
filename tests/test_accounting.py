"""The run account (``layercheck.orchestrator.core.accounting``): productive time, lost steps,
stalls and ETTR across failures."""

import pytest

from layercheck.orchestrator.core.accounting import RunAccount


def test_account_drops_lost_steps_from_productive_time():
    account = RunAccount(started=0.0)
    for step in range(1, 6):
        account.step_done(step, compute_s=1.0, stall_s=0.25 if step == 2 else 0.0, now=float(step), loss=5.0 - step)
    recovery = account.failed(t_fail=4, resumed_at=5, now=12.0)
    assert recovery.detect_restart_s == 7.0 and recovery.steps_redone == 0
    assert account.productive_s == 4.0 and account.lost_step_seconds == 1.0
    assert sorted(account.history) == [1, 2, 3, 4]
    assert account.ettr(now=20.0) == pytest.approx(0.2)
    assert account.stall_seconds == 0.25 and account.stalls == 1
    again = account.failed(t_fail=4, resumed_at=1, now=13.0)  # no composite: start over
    assert again.steps_redone == 4 and account.productive_s == 0.0
