"""From raw per-strategy measurements to the report, its tables, ETTR costs and README section."""

from __future__ import annotations

import pytest

from layercheck.bench import ettr, render_readme, report, report_text, summary
from layercheck.bench.formulas import trace_of
from layercheck.bench.presets import preset

STEPS, FAILURES = 10, (6,)


#: The first pass's matched intervals (``layercheck.bench.matched``) at staleness and drift.
MATCHED = {
    "staleness": 3,
    "drift": 2,
    "target_staleness": 2.0,
    "target_drift": 0.1,
    "interval_staleness": 1.0,
    "interval_drift": 0.1,
}


def _raw(
    name: str,
    kind: str,
    recovery: str,
    *,
    interval: int = 0,
    matched: str = "",
    train_s: float = 10.0,
    stall_s: float = 0.0,
    bytes_written: float = 0.0,
    events: int = 0,
    shift: float = 0.0,
    recoveries: list | None = None,
) -> dict:
    return {
        "strategy": {
            "name": name,
            "kind": kind,
            "recovery": recovery,
            "interval": interval,
            "matched": matched,
            "delta_density": 0.01,
            "policy": None,
        },
        "train_s": train_s,
        "stall_s": stall_s,
        "probe_s": 0.1,
        "bytes_written": bytes_written,
        "events": events,
        "freshness": {
            "mean_weighted_staleness": 2.0,
            "max_staleness": 4.0,
            "mean_unsaved_drift": 0.1,
            "max_unsaved_drift": 0.2,
        },
        "recoveries": recoveries or [],
        "losses": {str(s): 3.0 - 0.1 * s + (shift if s > FAILURES[0] else 0.0) for s in range(1, STEPS + 1)},
    }


def _recovery(**kw) -> dict:
    return {
        "t_fail": 6,
        "resume_after": 6,
        "steps_lost": 0,
        "plan_s": 0.1,
        "load_s": 0.2,
        "replay_s": 0.0,
        "drain_s": 0.0,
        "recovery_s": 0.3,
        "weighted_staleness": 1.5,
        "max_staleness": 3,
        **kw,
    }


@pytest.fixture()
def built() -> dict:
    raw = {
        "restart_s": 2.0,
        "params": 1000,
        "frozen_params": 500,
        "layers": {"embed": 500, "block.0": 500},
        "results": {
            "none": {
                **_raw("none", "none", "restart"),
                "trace": trace_of(
                    {"embed": 500, "block.0": 500},
                    {t: {"embed": 0.1, "block.0": 0.1} for t in range(1, STEPS + 1)},
                    {t: 1e-3 for t in range(1, STEPS + 1)},
                ).to_json(),
            },
            "full": _raw(
                "full",
                "deepspeed-sync",
                "rollback",
                interval=5,
                train_s=11.0,
                stall_s=1.0,
                bytes_written=24000,
                events=2,
                recoveries=[_recovery(resume_after=5, steps_lost=1, replay_s=1.0, recovery_s=1.3)],
            ),
            "layercheck": {
                **_raw(
                    "layercheck",
                    "layer-policy",
                    "resume",
                    train_s=10.2,
                    stall_s=0.05,
                    bytes_written=18000,
                    events=6,
                    shift=0.01,
                    recoveries=[_recovery()],
                ),
                "handed_state_bytes": {"total": 15000, "peak_step": 6000},
            },
            "full@stal": _raw(
                "full@stal",
                "deepspeed-sync",
                "rollback",
                interval=3,
                matched="staleness",
                train_s=11.5,
                stall_s=1.5,
                bytes_written=36000,
                events=3,
                recoveries=[_recovery(resume_after=6, steps_lost=0, recovery_s=0.3)],
            ),
            "_matched": dict(MATCHED),
        },
    }
    workload = preset("tiny", steps=STEPS, failures=FAILURES, layercheck_warmup=2).to_json()
    return report.build_report(raw, workload, {"nproc": 2})


def test_rows(built):
    rows = built["strategies"]
    assert rows["full"]["overhead"] == pytest.approx(0.1)
    assert rows["full"]["bytes_per_event"] == 12000
    assert rows["full"]["steps_lost"] == 1
    # a rollback's re-run steps are simulated by the ETTR model, not counted as recovery time
    assert rows["full"]["recovery_s"] == pytest.approx(0.3)
    assert rows["full"]["recovery_total_s"] == pytest.approx(1.3)
    assert rows["layercheck"]["loss_dev_max"] == pytest.approx(0.01)
    assert rows["full"]["loss_dev_max"] == 0
    # none is modelled: a failure at 6 re-runs 6 steps of 1 s
    assert rows["none"]["steps_lost"] == 6 and rows["none"]["replay_s"] == pytest.approx(6.0)
    # ETTR with none's training time plus the critical-path cost (stall + probe for LayerCheck)
    assert rows["layercheck"]["ettr"] == pytest.approx(10.0 / (10.0 + 0.15 + 0.3 + 2.0))
    assert rows["layercheck"]["overhead"] == pytest.approx(0.015)
    assert rows["layercheck"]["wall_overhead"] == pytest.approx(0.02)
    assert rows["layercheck"]["model_step_s"] == pytest.approx(1.0 + (0.05 + 0.1) / STEPS)


def test_pairs_and_headline(built):
    (pair,) = built["pairs"]
    assert pair["baseline"] == "full@stal" and pair["bytes_ratio"] == pytest.approx(0.5)
    assert built["headline"]["bytes_layercheck_vs_full_at_matched_staleness"] == pytest.approx(0.5)
    assert built["headline"]["bytes_layercheck_vs_full_at_matched_drift"] is None


def test_layercheck_variants_get_an_estimate_at_their_own_matched_freshness(built):
    estimate = built["strategies"]["layercheck"]["matched_estimate"]
    assert estimate["per_checkpoint_bytes_from"] == "full"
    n = estimate["interval_staleness"]
    assert estimate["full_bytes_staleness"] == 12000 * (STEPS // n)
    assert built["headline"]["bytes_estimate_vs_full_at_own_matched_staleness"]["layercheck"] == pytest.approx(
        18000 / (12000 * (STEPS // n))
    )


def test_text_forms(built):
    assert "layercheck" in report_text.text(built)
    md = summary.summary_markdown(built, plots=["x.png"])
    assert "![x.png](x.png)" in md and "0.50x" in md


def test_ettr_costs_from_the_report(built):
    costs = {c.name: c for c in ettr.costs_from_bench(built)}
    assert costs["full"].recovery == "rollback" and costs["full"].interval == 5 and costs["full"].sync_write
    assert costs["layercheck"].restart_s == 2.0
    g = ettr.grid(list(costs.values()), mtbf_hours=(1.0,), gpu_counts=(8,), runs=3)
    assert set(g["by_mtbf"]) == {"none", "full", "layercheck", "full@stal"}


def test_readme_section_quotes_the_report(built):
    g = ettr.grid(ettr.costs_from_bench(built), mtbf_hours=(0.5, 24.0), gpu_counts=(8, 16384), runs=3)
    text = render_readme.section(built, g, "bench/results/x")
    assert text.startswith("## Performance")
    assert "0.50x" in text and "bench/results/x/bench.json" in text


def test_readme_section_quotes_the_ray_demo_when_present(built):
    g = ettr.grid(ettr.costs_from_bench(built), mtbf_hours=(1.0,), gpu_counts=(8,), runs=3)
    demo = {"coordination_s_per_step": {"mean": 0.001, "p90": 0.002}, "step_s_per_step": {"mean": 0.1}}
    assert "1.00 ms" in render_readme.section(built, g, "r", demo)


def test_bytes_from_warmup_counts_only_checkpoints_from_w():
    full = {"kind": "deepspeed-sync", "interval": 10, "bytes_per_event": 100.0, "bytes_written": 1000.0, "events": 10}
    assert report.bytes_from(full, since=25, steps=100, per_full_event=None) == 800.0  # 30, 40, ..., 100
    lc = {"kind": "layer-policy", "interval": 0, "bytes_per_event": 5.0, "bytes_written": 70.0, "events": 14}
    assert report.bytes_from(lc, since=25, steps=100, per_full_event=None) == 70.0
    # diff: fulls at 10, 20 (100 B each), deltas at 11..19 (9 x 2 B)
    diff = {"kind": "differential", "interval": 10, "bytes_per_event": 0.0, "bytes_written": 218.0, "events": 11}
    assert report.bytes_from(diff, since=15, steps=20, per_full_event=100.0) == pytest.approx(100 + 5 * 2)


def test_peak_bytes_per_step_for_every_strategy(built):
    rows = built["strategies"]
    full_checkpoint = 1000 * 12 + 500 * 4  # trainable state + frozen fp32 weights
    assert rows["full"]["peak_step_bytes"] == 12000  # a whole checkpoint as measured
    assert rows["layercheck"]["peak_step_bytes"] == 6000
    assert rows["layercheck"]["peak_fraction_of_full"] == pytest.approx(6000 / full_checkpoint)
    assert rows["none"]["peak_step_bytes"] == 0.0
    assert built["headline"]["peak_step_bytes"]["layercheck"] == 6000
    assert "peak/step" in report_text.text(built) and "peak/step" in summary.summary_markdown(built)


def test_layer_policies_against_full_and_the_oracle_at_their_own_unsaved_drift(built):
    at = built["strategies"]["layercheck"]["at_matched_drift"]
    assert at["full_checkpoint_bytes"] == 14000 and at["state_bytes"] == 15000
    n = at["full_interval"]
    assert at["full_bytes"] == 14000 * (STEPS // n - (2 - 1) // n)
    assert at["vs_full"] == pytest.approx(15000 / at["full_bytes"])
    # uniform drift: the oracle is equal periods, so it cannot beat full checkpoints' trainable part by much
    assert 0 < at["oracle_bytes"] <= at["full_bytes"]
    assert built["headline"]["state_bytes_vs_oracle_at_own_matched_drift"]["layercheck"] == at["vs_oracle"]
    assert "vs oracle" in report_text.text(built)


def test_readme_section_quotes_the_schedule_figures(built):
    g = ettr.grid(ettr.costs_from_bench(built), mtbf_hours=(1.0,), gpu_counts=(8,), runs=3)
    text = render_readme.section(built, g, "r")
    assert "the oracle" in text and "Peak bytes handed over in one step" in text


def test_reports_without_the_schedule_figures_still_build():
    from layercheck.bench.schedule_report import peak_step_bytes

    assert peak_step_bytes({"kind": "layer-policy"}, {}) is None
