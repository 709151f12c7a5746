"""``persistence.memory_period``'s promise under the local runtime, on 2 gloo ranks at ZeRO-3
(``tests/support/memory_jobs.py``): every layer stored after step 2 only, memory versions every
step, the group lost after step 5 and every slice recovered from the composite. With a budget that
holds a whole memory version the recovery is exact (every loss after it is the failure-free run's);
with one short of it the run is told so at its start, with the budget it needs, and the summary
names the elements that came back more than ``memory_period`` steps stale."""

from __future__ import annotations

import pytest

from layercheck.orchestrator.runtime.recovery_lines import period_check, recovery_rows
from tests.support.memory_jobs import FAIL_AFTER, PERIOD

pytestmark = pytest.mark.slow  # spawns 2 DeepSpeed ranks and trains 3 runs of 7 steps


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from tests.support import memory_jobs
    from tests.support.dist_harness import run_jobs

    (results,) = run_jobs(2, [(memory_jobs.memory_promise_job, (str(tmp_path_factory.mktemp("memory-promise")),))])
    return results


def losses(run) -> dict[int, float]:
    return {int(step): loss for step, loss in run["losses"].items()}  # (steps come back as JSON keys)


def summary_text(run) -> str:
    rows = recovery_rows({"recoveries": run["recoveries"], "memory_period": PERIOD})
    return "\n".join(f"{key}: {value}" for key, value in rows)


def test_with_a_budget_that_holds_a_memory_version_a_zero3_recovery_continues_the_failure_free_losses(ranks):
    clean, held = ranks[0]["clean"], ranks[0]["held"]
    assert held["promise"] == "" and [r["held"]["memory_dropped"] for r in ranks] == [0, 0]
    (recovery,) = held["recoveries"]
    assert (recovery["t_fail"], recovery["resumed_at"], recovery["max_staleness"]) == (FAIL_AFTER, FAIL_AFTER + 1, 0)
    for layer, sources in recovery["sources"].items():
        assert [(s["origin"], s["step"]) for s in sources] == [("memory", FAIL_AFTER)], layer
    check = period_check(recovery, PERIOD)
    assert check is not None and check.kept and check.elements > 0
    assert "memory_period kept" in summary_text(held)
    clean_losses, held_losses = losses(clean), losses(held)
    assert sorted(held_losses) == sorted(clean_losses) == list(range(1, max(clean_losses) + 1))
    for step in range(FAIL_AFTER + 1, max(clean_losses) + 1):
        assert held_losses[step] == clean_losses[step], step  # bit for bit: nothing came back stale


def test_a_budget_short_of_a_memory_version_is_told_at_the_start_and_its_late_elements_named(ranks):
    clean, short = ranks[0]["clean"], ranks[0]["short"]
    need = ranks[0]["need"]
    assert short["promise"].startswith(f"persistence.memory_period = {PERIOD} cannot be kept")
    assert f"set persistence.memory_bytes >= {need} to keep it" in short["promise"]
    assert all(r["short"]["memory_dropped"] > 0 for r in ranks)  # counted on every rank's writer
    # the local runtime's plan does not know which files the writers hold: a memory version they let
    # go is found missing at the load, like a corrupt one, and replanned around (one rejoin each)
    *replanned, recovery = short["recoveries"]
    assert all(r["interrupted"] and r["t_fail"] == FAIL_AFTER for r in replanned)
    check = period_check(recovery, PERIOD)
    assert check is not None and not check.kept
    assert 0 < check.late_elements < check.elements and check.max_staleness == FAIL_AFTER - 2  # stored after step 2
    origins = {s["origin"] for sources in recovery["sources"].values() for s in sources}
    assert origins == {"memory", "policy"}  # the layers it held came back fresh, the others from storage
    text = summary_text(short)
    assert "MEMORY_PERIOD NOT KEPT" in text and f"{check.late_elements:,} of {check.elements:,} elements" in text
    assert all(period_check(r, PERIOD) is None for r in replanned)  # the run went on from the last one's composite
    clean_losses, short_losses = losses(clean), losses(short)
    after = range(FAIL_AFTER + 1, max(clean_losses) + 1)
    assert any(short_losses[step] != clean_losses[step] for step in after)
