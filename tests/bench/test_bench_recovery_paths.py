"""The recovery-paths benchmark's table (bench/recovery_paths.py; its runs are Ray runs of minutes,
measured by hand): every phase of the summary's timeline, per path, and the ratio."""

from layercheck.bench.recovery_paths import table
from layercheck.orchestrator.core.accounting import RECOVERY_PHASES


def test_the_table_gives_each_paths_phases_and_the_ratio():
    phases = dict.fromkeys(RECOVERY_PHASES, 1.0)
    report = {
        "repeats": 2,
        "median": {
            "full restart": {"failure_to_step_s": 15.25, **phases},
            "in place": {"failure_to_step_s": 9.5, **phases},
        },
        "in_place_over_full_restart": 9.5 / 15.25,
    }
    text = table(report)
    assert text.splitlines()[0].split() == ["path", "(median", "s)", "failure_to_step_s", *RECOVERY_PHASES]
    assert "full restart" in text and "in place" in text
    assert text.endswith("in place / full restart: 0.62x (median of 2)")


def test_the_spare_path_gets_its_ratio_too():
    phases = dict.fromkeys(RECOVERY_PHASES, 1.0)
    medians = {"full restart": 15.0, "in place": 9.0, "in place + spare": 3.0}
    report = {
        "repeats": 1,
        "median": {path: {"failure_to_step_s": s, **phases} for path, s in medians.items()},
        "in_place_over_full_restart": 0.6,
        "spare_over_full_restart": 0.2,
    }
    assert table(report).endswith(
        "in place / full restart: 0.60x; in place + spare / full restart: 0.20x (median of 1)"
    )


def test_each_kind_of_rank_gets_its_own_phases_the_slowest_of_each_run_and_their_median():
    from layercheck.bench.recovery_paths import rank_medians, rank_table

    def rank(build_s: float, **kind) -> dict:
        return {
            "leave_s": 0.0,
            "start_s": 0.0,
            "waited_s": 0.0,
            "group_s": 0.0,
            "build_s": build_s,
            "load_s": 0.0,
            **kind,
        }

    runs = [
        {"ranks": [rank(1.0, kept_process=True), rank(0.5, spare=True)]},
        {"ranks": [rank(3.0, kept_process=True), rank(0.25, spare=True), rank(0.75, spare=True)]},
        {"ranks": [rank(2.0, kept_process=True), rank(4.0)]},  # no spare ready: a new process trained
    ]
    medians = rank_medians(runs)
    assert {kind: phases["build_s"] for kind, phases in medians.items()} == {
        "survivor": 2.0,
        "spare": 0.625,  # (0.5, 0.75): the slowest spare of each run that had one
        "new process": 4.0,
    }
    text = rank_table({"ranks": {"in place + spare": medians}})
    assert text.splitlines()[0].split() == [
        "path",
        "rank",
        "(median",
        "s)",
        "leave_s",
        "start_s",
        "waited_s",
        "group_s",
        "build_s",
        "load_s",
    ]
