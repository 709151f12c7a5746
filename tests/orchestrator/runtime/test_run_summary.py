"""The closing summary compares a selective policy's bytes with full checkpoints at the same
staleness (the matched interval read from the simulation's field, not parsed from its label);
the baselines get no comparison."""

import re
from dataclasses import replace

import pytest

from layercheck.orchestrator.core.accounting import RunAccount
from layercheck.orchestrator.core.run_config import RunConfig
from layercheck.orchestrator.runtime.progress_lines import ProgressLines
from layercheck.orchestrator.runtime.run_end import RunResult
from layercheck.orchestrator.runtime.run_summary import format_summary, summarize
from layercheck.policies.configs import drift_measured, policy_config
from layercheck.policies.simulation import compare
from layercheck.policies.trace import synthetic_trace
from layercheck.workers.config import ModelConfig
from layercheck.workers.progress import ProbeCost

TRACE = synthetic_trace(blocks=2, steps=300, warmup=30, seed=1)
COST = {"mean": 0.001, "p90": 0.002}


def result_of(policy) -> RunResult:
    account = {
        "failures": 0,
        "recoveries": [],
        "ettr": 1.0,
        "wall_s": 10.0,
        "productive_s": 10.0,
        "stall_s": 0.0,
        "coordination_s_per_step": COST,
        "step_s_per_step": {"mean": 0.1, "p90": 0.1},
    }
    status = {
        "state": "finished",
        "step": 300,
        "loss": 1.0,
        "account": account,
        "bytes_committed": 1200,
        "versions_committed": 3,
        "max_staleness": 5,
        "weighted_staleness": 2.5,
        "write_failures": 0,
    }
    config = RunConfig(model=ModelConfig(hf_config={"model_type": "llama"}), policy=policy)
    return RunResult(run_id="r", config=config, status=status, trace=TRACE, layer_numel=dict(TRACE.numel))


@pytest.mark.parametrize("name", ["layercheck", "drift-optimal"])
def test_a_selective_policy_is_compared_with_full_checkpoints(name):
    policy = policy_config(name, {"warmup_steps": 30})
    summary = summarize(result_of(policy))
    expected = compare(TRACE, policy, label=name, eval_from=30).matched_staleness
    assert summary["full_at_same_staleness"]["interval"] == expected.interval
    assert expected.policy == f"full/{expected.interval}"
    assert summary["full_at_same_staleness"]["bytes"] == expected.bytes_written
    assert f"every {expected.interval} steps" in format_summary(summary)
    by_drift = compare(TRACE, policy, label=name, eval_from=30).matched_drift
    assert summary["full_at_same_drift"]["interval"] == by_drift.interval
    assert "full checkpoints, same unsaved drift" in format_summary(summary)


def test_a_sampled_runs_unsaved_drift_is_said_to_be_estimated_between_measurements():
    policy = policy_config("staggered", {"warmup_steps": 30, "period": 20, "drift_every": 10})
    steps = tuple(o if drift_measured(o.step, 10) else replace(o, drift={}, measured=False) for o in TRACE.steps)
    result = replace(result_of(policy), trace=replace(TRACE, steps=steps))
    summary = summarize(result)
    assert summary["drift_measured_steps"] == 30
    assert "same unsaved drift (drift measured at 30 steps, the others estimated)" in format_summary(summary)
    assert "drift_measured_steps" not in summarize(result_of(policy))  # measured at every step: nothing to say


@pytest.mark.parametrize("name", ["interval", "never"])
def test_a_baseline_gets_no_comparison(name):
    summary = summarize(result_of(policy_config(name)))
    assert "full_at_same_staleness" not in summary
    assert "full checkpoints, same staleness" not in format_summary(summary)


def test_the_peak_per_step_and_the_write_budget_are_reported_beside_a_full_checkpoint():
    result = result_of(policy_config("staggered"))
    full = sum(TRACE.numel.values()) * 12
    result.schedule = {
        "peak_step_bytes": full // 4,
        "peak_step": 7,
        "handed_bytes": 3 * full,
        "write_budget_bytes": 2048,
        "drain_bytes_per_second": 1024.0**2,
        "write_budget_enabled": True,
    }
    summary = summarize(result)
    assert summary["peak_step_bytes"] == full // 4 and summary["peak_step_fraction_of_full"] == pytest.approx(0.25)
    assert summary["write_budget_bytes_per_step"] == 2048 and summary["drain_bytes_per_second"] == 1024.0**2
    text = format_summary(summary)
    assert "peak bytes in one step" in text and "at step 7 (0.25 of a full checkpoint)" in text
    assert "2.00 KiB/step (writers drain 1.00 MiB/s)" in text
    matched = summary["full_at_same_drift"]["bytes"]  # the schedule's own bytes are what is compared
    assert f"(the schedule handed over {3 * full / matched:.2f}x that)" in text


def test_the_drivers_progress_lines_come_every_log_every_steps_with_loss_staleness_and_ettr():
    """What ``ray job logs`` shows of a ``layercheck train`` job (Ray's dashboard shows no
    ``ray.train.report`` metrics): one line per ``log_every`` steps, and one per state change,
    however often the driver polls."""
    progress = ProgressLines(log_every=10)
    status = result_of(policy_config("staggered")).status | {"state": "running", "lr": 1e-3, "metrics_url": "http://m"}
    shown = []
    for step in (1, 1, 4, 9, 10, 11, 19, 23, 23, 24, 31):
        shown += progress(status | {"step": step, "loss": 2.0 + step / 100})
    shown += progress(status | {"step": 31, "state": "recovering"})
    assert shown[0] == "metrics at http://m"
    assert [int(line.split(" step ")[1].split()[0]) for line in shown[1:]] == [1, 10, 23, 31, 31]
    assert shown[2] == (
        "[running] step 10  loss 2.1  lr 1.00e-03  written 1.17 KiB (3 versions)  max staleness 5  ETTR 1.00"
    )
    assert shown[-1].startswith("[recovering] step 31 ")


def test_a_recovery_says_how_many_elements_came_from_captures_and_from_stored_versions():
    from layercheck.orchestrator.core.accounting import RunAccount

    account = RunAccount(started=0.0)
    recovery = account.failed(t_fail=14, resumed_at=15, now=1.0)
    recovery.sources = {
        "norm": [
            {"origin": "capture", "version_id": "c", "step": 14, "ranks": [0], "elements": 21, "partial": True},
            {"origin": "policy", "version_id": "w", "step": 10, "ranks": [0, 1], "elements": 21, "partial": False},
        ]
    }
    result = result_of(policy_config("staggered"))
    result.status["account"] = {**result.status["account"], **account.summary(2.0)}
    summary = summarize(result)
    assert summary["recovered_elements"] == {"capture": 21, "memory": 0, "stored": 21, "initial": 0}
    text = format_summary(summary)
    assert "elements from" in text and "capture@14 21 (1 layer); policy@10 21 (1 layer)" in text
    assert "21 from survivors' captures, 21 stored" in text
    # the price of no rollback, and the knob for it
    assert "21 of 42 elements (50%) came back 4.0 steps stale on average (at most 4)" in text
    assert "persistence.memory_period = P" in text


def test_each_recovery_says_whether_memory_period_was_kept_from_what_it_loaded():
    """With ``persistence.memory_period = 2`` the summary judges each recovery by its sources: the
    first took every element from step t_fail - 2 or later (kept); the second took block.1 from a
    version 6 steps old (its memory version was not held): not kept, with how many and how stale.
    A ``--resume`` promised nothing and is not judged."""
    account = RunAccount(started=0.0)
    first = account.failed(t_fail=10, resumed_at=11, now=1.0)
    first.sources = {
        "block.0": [{"origin": "capture", "step": 10, "elements": 30}, {"origin": "memory", "step": 8, "elements": 30}],
        "norm": [{"origin": "memory", "step": 8, "elements": 4}],
    }
    account.step_done(11, 0.1, 0.0, 1.5)  # its first step: not overtaken by the next failure
    second = account.failed(t_fail=20, resumed_at=21, now=2.0)
    second.sources = {
        "block.0": [{"origin": "memory", "step": 20, "elements": 60}],
        "block.1": [
            {"origin": "capture", "step": 20, "elements": 30},
            {"origin": "policy", "step": 14, "elements": 30},
        ],
    }
    account.step_done(21, 0.1, 0.0, 2.5)
    account.failed(t_fail=25, resumed_at=26, now=3.0, lost_group=False).kind = "resume"
    account.recoveries[-1].sources = {"block.0": [{"origin": "policy", "step": 1, "elements": 60}]}
    result = replace(result_of(policy_config("staggered")), memory_period=2)
    result.status["account"] = {**result.status["account"], **account.summary(4.0)}
    result.status["memory"] = {
        **{"writers": 1, "budget_bytes_per_writer": 1000, "mirror": False, "held_bytes": 900, "held_shards": 9},
        **{"mirror_bytes": 0, "evicted_shards": 12, "memory_versions_dropped": 5},
    }
    summary = summarize(result)
    kept, broken = summary["memory_period_checks"]
    assert (kept["t_fail"], kept["kept"], kept["late_elements"], kept["elements"]) == (10, True, 0, 64)
    assert (broken["t_fail"], broken["kept"], broken["late_elements"], broken["max_staleness"]) == (20, False, 30, 6)
    assert broken["late_layers"] == ["block.1"]
    text = format_summary(summary)
    assert "memory_period kept" in text and "every element came back at most 2 steps stale" in text
    assert "MEMORY_PERIOD NOT KEPT" in text
    assert "30 of 120 elements (25%) came back more than 2 steps stale (6.0 on average, at most 6)" in text
    assert "persistence.memory_period = P" not in text  # set already: the rows above say how it did
    assert "12 evicted, 5 of them memory versions' (persistence.memory_bytes cannot hold a whole" in text
    assert summarize(result_of(policy_config("staggered")))["memory_period_checks"] == []  # off: nothing judged


def test_an_auto_period_is_named_with_why_and_each_recovery_is_judged_by_the_period_in_force_at_it():
    """``persistence.memory_period = "auto"``: every step until the run chose 3 from its timings of
    steps up to 6. A failure at step 5 is judged against 1 (its element from step 3 is late), one at
    step 12 against 3 (from step 9: kept); the summary's row names the period and why."""
    account = RunAccount(started=0.0)
    early = account.failed(t_fail=5, resumed_at=6, now=1.0)
    early.sources = {
        "block.0": [{"origin": "memory", "step": 4, "elements": 30}, {"origin": "policy", "step": 3, "elements": 2}]
    }
    account.step_done(6, 0.1, 0.0, 1.5)
    late = account.failed(t_fail=12, resumed_at=13, now=2.0)
    late.sources = {"block.0": [{"origin": "memory", "step": 9, "elements": 32}]}
    account.step_done(13, 0.1, 0.0, 2.5)
    result = result_of(policy_config("staggered"))
    why = "auto: 3 (copy 2.5 ms = 2.5% of a 100.0 ms step, 0.83% a step every 3; 1.00 MiB of 2.00 GiB per writer)"
    result.status["memory_period"] = {"period": 3, "why": why, "auto": True, "start": 1, "chosen_at": 6}
    result.status["account"] = {**result.status["account"], **account.summary(3.0)}
    summary = summarize(result)
    assert summary["memory_period"] == 3 and summary["memory_period_choice"]["why"] == why
    early_check, late_check = summary["memory_period_checks"]
    assert (early_check["period"], early_check["kept"], early_check["late_elements"]) == (1, False, 2)
    assert (late_check["period"], late_check["kept"]) == (3, True)
    text = format_summary(summary)
    assert re.search(rf"^memory versions +{re.escape(why)}$", text, re.M), text
    assert "every element came back at most 3 steps stale" in text and "more than 1 step stale" in text
    unset = summarize(result_of(policy_config("staggered")))  # a status from before the supervisor said
    assert unset["memory_period_choice"]["why"] == "off (persistence.memory_period = 0)"


def test_a_capture_is_matched_to_the_recovery_that_followed_its_group_not_by_position():
    """Group 1 broke after step 10 and the group that replaced it (2) was lost during the recovery,
    so the run resumed under attempt 3; group 3 broke after step 20 with a survivor one step ahead.
    Its capture belongs to the second recovery (attempt 4), which ``recoveries[attempt - 1]``
    (there is no third) missed."""
    from layercheck.orchestrator.core.accounting import RunAccount
    from layercheck.orchestrator.runtime.recovery_lines import recovery_of_capture

    account = RunAccount(started=0.0)
    account.failed(t_fail=10, resumed_at=11, now=1.0).attempt = 3
    account.failed(t_fail=20, resumed_at=21, now=2.0).attempt = 4
    capture = {
        "captures": [
            {"attempt": 3, "rank": 0, "step": 21, "nbytes": 1024, "seconds": 0.1, "raised_at": 1.5, "held": True}
        ],
        "holds": [{"attempt": 3, "survivors": [0], "captured": [0], "missed": [], "teardown_at": 1.7, "hold_s": 0.2}],
    }
    result = result_of(policy_config("staggered"))
    result.status["account"] = {**result.status["account"], **account.summary(3.0), "capture": capture}
    summary = summarize(result)
    recoveries = summary["recoveries"]
    assert recovery_of_capture(recoveries, 3)["t_fail"] == 20
    assert recovery_of_capture(recoveries, 1)["t_fail"] == 10
    assert recovery_of_capture(recoveries, 2)["t_fail"] == 10  # lost during the first recovery, which it joined
    assert recovery_of_capture(recoveries, 4) is None
    assert "a capture past t_fail 20 is not used" in format_summary(summary)


def test_the_summary_says_when_the_store_does_not_hold_the_final_state(tmp_path):
    """Storage that broke before the end: 'finished' is the training, not the store; the row says
    what export and --resume get. With every layer at the last step it says so in one line."""
    from layercheck.orchestrator.store.layer_store import LayerStore
    from layercheck.orchestrator.store.recovery_source import stored_at
    from tests.support.store_helpers import write_layer

    store = LayerStore.open(str(tmp_path))
    numel = {"embed": 42, "block.0": 42, "norm": 42}
    for layer in numel:
        write_layer(store, layer, 43)
    write_layer(store, "norm", 60)
    result = result_of(policy_config("staggered"))
    result.status = {**result.status, "step": 60, "stored": stored_at(store, numel, 60)}
    text = format_summary(summarize(result))
    assert "NOT the final state: 1 of 3 layers at step 60, embed, block.0 older; export and --resume take" in text
    for layer in ("embed", "block.0"):
        write_layer(store, layer, 60)
    result.status = {**result.status, "stored": stored_at(store, numel, 60)}
    assert "every layer at step 60" in format_summary(summarize(result))


def test_a_recovery_says_its_path_and_why_an_in_place_run_fell_back_to_a_full_restart():
    from layercheck.orchestrator.core.accounting import FallbackReason, RankStart, RunAccount

    account = RunAccount(started=0.0)
    account.step_done(1, compute_s=0.5, stall_s=0.0, now=1.0)
    kept = account.failed(t_fail=1, resumed_at=2, now=2.0)
    kept.in_place = True
    kept.rank_ready(RankStart(kept_process=True), now=3.0)
    account.step_done(2, compute_s=0.5, stall_s=0.0, now=4.0)
    restarted = account.failed(t_fail=2, resumed_at=3, now=5.0)
    restarted.in_place, restarted.refused = True, FallbackReason("rank_failed", "rank 0: ValueError: bad batch")
    account.step_done(3, compute_s=0.5, stall_s=0.0, now=9.0)
    replaced = account.failed(t_fail=3, resumed_at=4, now=10.0)  # a rank's own error, the other kept its process
    replaced.in_place, replaced.refused = True, FallbackReason("rank_failed", "rank 1: ValueError: bad batch")
    replaced.rank_ready(RankStart(kept_process=True), now=11.0)
    account.step_done(4, compute_s=0.5, stall_s=0.0, now=12.0)
    result = result_of(policy_config("staggered"))
    result.status["account"] = {**result.status["account"], **account.summary(13.0)}
    text = format_summary(summarize(result))
    assert "in place (1 rank kept its process)" in text
    assert (
        "full restart (not in place: a survivor's own step failed, not for a lost peer; rank 0: ValueError: bad batch)"
        in text
    )
    assert "in place (1 rank kept its process, replaced a rank whose own step failed: rank 1: ValueError" in text


def test_a_recovery_that_the_next_failure_overtook_says_so_and_is_no_fallback():
    """A replacement lost while the survivors regroup: the first recovery never reached a step, nor
    any rank's load, so nothing tells its path. It said "full restart (not in place: no rank
    survived the failure); no step after it yet", which was neither. It now says it was
    interrupted (its record's ``path`` too), and counts as no fallback; the next one says how it went."""
    from layercheck.orchestrator.core.accounting import RankStart, RunAccount

    account = RunAccount(started=0.0)
    account.step_done(6, compute_s=0.5, stall_s=0.0, now=1.0)
    first = account.failed(t_fail=6, resumed_at=7, now=2.0)
    first.in_place = True
    assert first.fallback == "no_survivor" and not first.interrupted  # (what it says while it is under way)
    second = account.failed(t_fail=6, resumed_at=7, now=4.0)
    second.in_place = True
    second.rank_ready(RankStart(kept_process=True), now=5.0)
    account.step_done(7, compute_s=0.5, stall_s=0.0, now=6.0)
    assert first.interrupted and first.fallback == "" and not second.interrupted
    assert [r["path"] for r in account.summary(7.0)["recoveries"]] == ["interrupted", "in place"]  # the JSON record
    result = result_of(policy_config("staggered"))
    result.status["account"] = {**result.status["account"], **account.summary(7.0)}
    text = format_summary(summarize(result))
    assert "resumed at 7; interrupted by the next failure before its first step: restart" in text
    assert "not in place" not in text and "no step after it yet" not in text
    assert "in place (1 rank kept its process)" in text


def test_an_overtaken_recovery_still_names_the_rank_whose_own_step_failed():
    """A rank's own step raised, and its replacement was lost during the recovery: the first
    recovery was overtaken, yet the failure it answered is the run's only word on why rank 1 went."""
    from layercheck.orchestrator.core.accounting import FallbackReason, RankStart, RunAccount

    account = RunAccount(started=0.0)
    account.step_done(6, compute_s=0.5, stall_s=0.0, now=1.0)
    first = account.failed(t_fail=6, resumed_at=7, now=2.0)
    first.in_place, first.refused = True, FallbackReason("rank_failed", "rank 1: ValueError: bad batch")
    second = account.failed(t_fail=6, resumed_at=7, now=4.0)
    second.in_place = True
    second.rank_ready(RankStart(kept_process=True), now=5.0)
    account.step_done(7, compute_s=0.5, stall_s=0.0, now=6.0)
    result = result_of(policy_config("staggered"))
    result.status["account"] = {**result.status["account"], **account.summary(7.0)}
    text = format_summary(summarize(result))
    overtaken = "interrupted by the next failure before its first step (replaced a rank whose own step failed: rank 1"
    assert overtaken in text, text
    assert "in place (1 rank kept its process)" in text


def test_the_bytes_written_include_the_partial_versions_beside_the_whole_ones():
    result = result_of(policy_config("staggered"))
    assert "partial version" not in format_summary(summarize(result))  # none: nothing said
    result.status.update(partial_bytes_committed=3 * 1024 * 1024, partial_versions_committed=2)
    text = format_summary(summarize(result))
    assert "in 3 layer versions" in text and "and 3.00 MiB in 2 partial versions (some ranks' slices" in text


def test_the_summary_says_what_the_warm_spares_cost_and_did():
    result = result_of(policy_config("staggered"))
    result.config = replace(result.config, cluster=replace(result.config.cluster, in_place=True, spares=1))
    result.status["spares"] = {"spares": 1, "waiting": 1, "promotions": 1}
    summary = summarize(result)
    assert summary["spares"]["training_workers"] == 2
    text = format_summary(summary)
    assert (
        "1 worker held idle beside the 2 training (1 CPU each, 50% more workers: cluster.spares); promoted 1 time"
        in text
    )
    assert summarize(result_of(policy_config("staggered")))["spares"] is None


def test_the_summary_names_the_drift_probe_and_what_its_own_work_cost_per_step():
    account = RunAccount(started=0.0)
    for step in range(1, 11):  # measured every 5th step: 4 ms each, nothing between
        measured = drift_measured(step, 5)
        account.probe.add(ProbeCost("snapshot_diff", 0.004 if measured else 0.0, measured))
    result = result_of(policy_config("staggered"))
    assert "drift probe" not in format_summary(summarize(result))  # no step reported one: nothing said
    result.status["account"]["drift_probe"] = account.summary(now=1.0)["drift_probe"]
    summary = summarize(result)
    measured_steps = sum(drift_measured(s, 5) for s in range(1, 11))
    assert summary["drift_probe"]["measured_steps"] == measured_steps
    assert summary["drift_probe"]["s_per_measured_step"] == pytest.approx(0.004)
    per_step = 0.004 * measured_steps / 10
    text = format_summary(summary)
    assert (
        f"snapshot_diff, measured at {measured_steps} of 10 steps: 4.00 ms a measured step (the diff against a copy"
        in text
    )
    assert f"{per_step * 1e3:.2f} ms a step ({per_step / 0.1:.1%} of the 100 ms mean step)" in text


def test_a_probe_that_steps_in_place_of_the_users_adamw_is_read_against_that_step():
    """The fused step in place of the user's AdamW times the whole update: the summary sets it
    against the user's own step (timed on the step after each such step) and counts the
    difference as the probe's cost, not the whole update. A step measured by copying instead (a
    closure, say) adds its copy and diff to the user's step: it is counted whole."""
    account = RunAccount(started=0.0)
    costs = {  # measured at steps 1 and 6 (the fused step, 6 ms; by copying, 2 ms); step 2: the user's step, 5 ms
        1: {"seconds": 0.006, "measured": True, "replaced": True},
        2: {"seconds": 0.0, "measured": False, "own_step_s": 0.005, "own_steps": 1},
        6: {"seconds": 0.002, "measured": True},
    }
    for step in range(1, 11):
        account.probe.add(
            ProbeCost("fused (in place of your AdamW)", **costs.get(step, {"seconds": 0.0, "measured": False}))
        )
    result = result_of(policy_config("staggered"))
    result.status["account"]["drift_probe"] = account.summary(now=1.0)["drift_probe"]
    probe = summarize(result)["drift_probe"]
    assert probe["own_steps"] == 1 and probe["s_per_own_step"] == pytest.approx(0.005)
    assert probe["s_per_measured_step"] == pytest.approx(0.004)
    assert probe["added_s_per_measured_step"] == pytest.approx(0.0015)  # (6 - 5 + 2) ms over 2 measured steps
    assert probe["added_s_per_step"] == pytest.approx(0.0003)
    text = format_summary(summarize(result))
    assert (
        "4.00 ms a measured step (the whole AdamW update, run in place of yours with the drift counted inside it), "
        "against 5.00 ms for your AdamW's own step (timed on 1 unmeasured steps): "
        "+1.50 ms a measured step, +0.30 ms a step (0.3% of the 100 ms mean step)"
    ) in text


def test_the_writers_host_memory_row_splits_their_resident_memory():
    """What the writer processes hold (``SupervisorActor.memory_view``'s ``host``): their own
    resident memory against runtime + held + in flight, and the object store's shared pages apart."""
    mib = 2**20
    host = {
        "writers": 2,
        **{"memory_version_bytes": 600 * mib, "stored_copy_bytes": 40 * mib, "mirror_bytes": 0},
        **{"encoding_bytes": 0, "capture_copy_bytes": 0, "object_store_bytes": 0, "mirror_sending_bytes": 0},
        **{"runtime_bytes_max": 310 * mib, "own_bytes_max": 650 * mib, "shmem_bytes_max": 900 * mib},
        **{"unaccounted_bytes_max": 5 * mib, "peak_own_bytes_max": 700 * mib, "peak_unaccounted_bytes_max": 9 * mib},
    }
    result = result_of(policy_config("staggered"))
    result.status["memory"] = {
        **{"writers": 2, "budget_bytes_per_writer": 512 * mib, "mirror": False, "held_bytes": 640 * mib},
        **{"held_shards": 9, "mirror_bytes": 0, "evicted_shards": 0, "host": host},
    }
    text = format_summary(summarize(result))
    row = next(line for line in text.splitlines() if "writer host memory" in line)
    assert "own RSS 650.00 MiB (peak 700.00 MiB) for the largest of 2 writer(s)" in row
    assert "runtime 310.00 MiB each + held 640.00 MiB (memory versions 600.00 MiB" in row
    assert "not accounted for: 5.00 MiB (at most 9.00 MiB)" in row
    assert "Ray object-store pages mapped 900.00 MiB (the node's shared object store" in row
    result.status["memory"]["host"] = {}  # the local runtime: no writer process of its own
    assert "writer host memory" not in format_summary(summarize(result))
