"""The unsaved drift at recovery: from each rank's L1 to the report's figures, ratios and tables."""

from __future__ import annotations

import pytest

from layercheck.bench import recovery_report, render_readme, report, report_text, summary
from layercheck.bench.presets import preset
from layercheck.bench.unsaved import summarize
from tests.bench.test_bench_report import FAILURES, MATCHED, STEPS, _raw, _recovery


def test_summarize_splits_the_survivors_from_the_lost_rank():
    # rank 0 (survivor) exact, rank 1 (lost) off by 2 over 4 elements of block.0 and 1 over 2 of embed
    u = summarize([{"embed": (0.0, 2), "block.0": (0.0, 4)}, {"embed": (1.0, 2), "block.0": (2.0, 4)}], lost_rank=1)
    assert u["l1"] == 3.0 and u["mean_abs"] == pytest.approx(3 / 12)
    assert u["survivors_mean_abs"] == 0.0 and u["lost_mean_abs"] == pytest.approx(3 / 6)
    assert u["layers"]["embed"] == {"l1": 1.0, "mean_abs": 0.25, "numel": 4}
    assert [r["numel"] for r in u["ranks"]] == [6, 6]


def _unsaved(survivor: float, lost: float) -> dict:
    return summarize([{"embed": (survivor, 10)}, {"embed": (lost, 10)}], lost_rank=1)


@pytest.fixture()
def built() -> dict:
    lc = _raw("layercheck", "layer-policy", "resume", bytes_written=1000, events=4, shift=0.02)
    lc["recoveries"] = [_recovery(unsaved=_unsaved(1.0, 1.0))]
    cap = _raw("layercheck+capture", "layer-policy", "resume", bytes_written=1500, events=4, shift=0.01)
    cap["recoveries"] = [_recovery(unsaved=_unsaved(0.0, 1.0))]
    cap["capture_bytes"] = 500.0
    raw = {
        "restart_s": 1.0,
        "params": 20,
        "frozen_params": 0,
        "layers": {"embed": 20},
        "results": {"none": _raw("none", "none", "restart"), "layercheck": lc, "layercheck+capture": cap},
    }
    workload = preset("tiny", steps=STEPS, failures=FAILURES, layercheck_warmup=2).to_json()
    return report.build_report(raw, workload, {"nproc": 2})


def test_ratios_against_layercheck(built):
    row = built["strategies"]["layercheck+capture"]
    assert row["unsaved_at_recovery"] == pytest.approx(1 / 20)
    assert row["unsaved_survivors"] == 0.0 and row["unsaved_lost_rank"] == pytest.approx(0.1)
    assert row["unsaved_at_recovery_vs_layercheck"] == pytest.approx(0.5)
    assert row["loss_dev_mean_vs_layercheck"] == pytest.approx(0.5)
    assert row["bytes_vs_layercheck"] == pytest.approx(1.5) and row["capture_bytes"] == 500.0
    assert built["strategies"]["none"]["unsaved_at_recovery"] is None  # modelled, not measured
    assert built["headline"]["unsaved_at_recovery_vs_layercheck"] == {
        "layercheck": 1.0,
        "layercheck+capture": pytest.approx(0.5),
    }


def test_tables_show_the_measured_strategies_only(built):
    table = recovery_report.recovery_table(built)
    assert "layercheck+capture" in table and "none" not in table and "0.50x" in table
    assert "embed" in recovery_report.layer_table(built)
    assert "What a recovery brings back" in summary.summary_markdown(built)
    assert "unsaved drift at recovery per layer" in report_text.text(built)


def test_a_memory_tier_row_says_where_its_bytes_came_from_and_its_load_time_over_its_storage_twin():
    lc = _raw("layercheck", "layer-policy", "resume")
    lc["recoveries"] = [_recovery(unsaved=_unsaved(1.0, 1.0), sources={"storage_bytes": 400, "storage_shards": 4})]
    cap = _raw("layercheck+capture", "layer-policy", "resume")
    cap["strategy"]["tiers"] = ["capture"]
    cap["recoveries"] = [_recovery(load_s=0.2, sources={"storage_bytes": 600, "storage_shards": 6})]
    mem = _raw("layercheck+capture+memory", "layer-policy", "resume")
    mem["strategy"]["tiers"] = ["capture", "memory"]
    mem["recoveries"] = [
        _recovery(load_s=0.05, sources={"memory_local_bytes": 600, "memory_local_shards": 6, "storage_shards": 0})
    ]
    raw = {
        "restart_s": 1.0,
        "params": 20,
        "frozen_params": 0,
        "layers": {"embed": 20},
        "store": "s3-loopback",
        "results": {
            "none": _raw("none", "none", "restart"),
            "layercheck": lc,
            "layercheck+capture": cap,
            "layercheck+capture+memory": mem,
        },
    }
    workload = preset("tiny", steps=STEPS, failures=FAILURES, layercheck_warmup=2).to_json()
    built = report.build_report(raw, workload, {"nproc": 2})
    row = built["strategies"]["layercheck+capture+memory"]
    assert row["loaded_from_memory_bytes"] == 600 and row["loaded_from_storage_bytes"] == 0
    assert row["loaded_memory_share"] == 1.0 and row["load_storage_twin"] == "layercheck+capture"
    assert row["load_vs_storage"] == pytest.approx(0.25)
    assert "load_vs_storage" not in built["strategies"]["layercheck+capture"]  # no memory tier: no twin
    assert built["strategies"]["layercheck+capture"]["loaded_memory_share"] == 0.0
    assert "loaded_memory_share" not in built["strategies"]["none"]  # nothing reported
    assert built["headline"]["recovery_load_memory_vs_storage"] == {"layercheck+capture+memory": pytest.approx(0.25)}
    table = recovery_report.load_table(built)
    assert "0.25x of layercheck+capture" in table and "100%" in table
    assert "recovery loads (store s3-loopback)" in report_text.text(built)
    assert "Recovery loads: the writers' memory against storage" in summary.summary_markdown(built)
    (line,) = render_readme.memory_lines(built, "b")
    assert "store `s3-loopback`" in line and "**0.25x**" in line and "100% of the bytes from memory" in line
    text = render_readme.section(built, {}, "r", remote=(built, "r-s3"))  # a second run on remote-like storage
    assert text.count("Recovery load from the writers' memory") == 2 and "(r-s3/bench.json)" in text


def test_the_interval_baselines_at_layercheck_s_bytes_in_the_recovery_table_and_headline():
    lc = _raw("layercheck", "layer-policy", "resume", bytes_written=1000, events=4, shift=0.02)
    lc["recoveries"] = [_recovery(unsaved=_unsaved(1.0, 1.0))]
    cap = _raw("layercheck+capture", "layer-policy", "resume", bytes_written=1500, events=4, shift=0.01)
    cap["recoveries"] = [_recovery(unsaved=_unsaved(0.0, 1.0))]
    resume = _raw(
        "full-resume@bytes", "layer-interval", "resume", interval=3, matched="bytes", bytes_written=1500, shift=0.04
    )
    resume["events"] = 3
    resume["recoveries"] = [_recovery(unsaved=_unsaved(4.0, 4.0))]
    rollback = _raw("full@bytes", "deepspeed-sync", "rollback", interval=4, matched="bytes", bytes_written=1600)
    rollback["events"] = 2
    rollback["recoveries"] = [_recovery(resume_after=4, steps_lost=2, unsaved=_unsaved(0.0, 0.0))]
    matched = {
        **MATCHED,
        "bytes": {"full": 4, "full-resume": 3},
        "bytes_skipped": {},
        "bytes_clipped_to_min_interval": 4,
        "bytes_unfloored": {"full": 2},
        "bytes_target": "layercheck+capture",
        "target_bytes": 1500.0,
        "bytes_per_checkpoint": {"full": 800.0, "full-resume": 500.0},
    }
    raw = {
        "restart_s": 1.0,
        "params": 20,
        "frozen_params": 0,
        "layers": {"embed": 20},
        "results": {
            "none": _raw("none", "none", "restart"),
            "layercheck": lc,
            "layercheck+capture": cap,
            "full-resume@bytes": resume,
            "full@bytes": rollback,
            "_matched": matched,
        },
    }
    workload = preset("tiny", steps=STEPS, failures=FAILURES, layercheck_warmup=2).to_json()
    built = report.build_report(raw, workload, {"nproc": 2})
    rows = built["strategies"]
    assert rows["layercheck+capture"]["unsaved_vs_full_resume_at_bytes"] == pytest.approx(0.125)
    assert rows["layercheck"]["loss_dev_mean_vs_full_resume_at_bytes"] == pytest.approx(0.5)
    assert "unsaved_vs_full_resume_at_bytes" not in rows["full@bytes"]  # only the layer-wise policies
    h = built["headline"]
    assert h["unsaved_vs_full_resume_at_bytes"] == {"layercheck": 0.25, "layercheck+capture": pytest.approx(0.125)}
    assert h["loss_dev_vs_full_resume_at_bytes"]["layercheck+capture"] == pytest.approx(0.25)
    assert h["steps_lost_full_at_bytes"] == 2
    table = recovery_report.recovery_table(built)
    assert "full-resume@bytes" in table and "full@bytes" in table and "0.12x" in table
    md = summary.summary_markdown(built)
    assert "`full-resume@bytes` every **3** steps" in md and "`layercheck+capture` wrote" in md
    assert "2 floored at `min_matched_interval` = 4" in md and "`/FR@bytes`" in md
    assert "unsaved vs full resume at bytes: `layercheck` **0.25x**" in md
    assert "full@bytes every 4 steps" in report_text.text(built)
    assert any(p["matched_on"] == "bytes" for p in built["pairs"])
    (line,) = render_readme.recovery_lines(built, "b")
    assert "**0.12x** that of `full-resume` writing the same bytes (every 3 steps)" in line
    assert "re-ran 2.0 steps per failure" in line and "0.25x `full-resume@bytes`'s" in line
    without_rollback = {**built, "headline": {**h, "steps_lost_full_at_bytes": None}}  # full@bytes not run
    (line,) = render_readme.recovery_lines(without_rollback, "b")
    assert "**0.12x**" in line and "full@bytes`)" not in line
