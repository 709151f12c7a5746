import json

import pytest

from layercheck.orchestrator.cli.main import main
from layercheck.policies.configs import LayerCheckConfig, NeverConfig
from layercheck.policies.decision import StepObservation
from layercheck.policies.simulation import (
    BYTES_PER_PARAM,
    compare,
    match_interval,
    peak_backlog,
    simulate_config,
    simulate_interval,
    sweep_k0,
)
from layercheck.policies.trace import DriftTrace, TraceFormatError, synthetic_trace


def constant_trace(steps=100, drift=1.0):
    layers = ("embed", "block.0", "norm")
    numel = {"embed": 10, "block.0": 30, "norm": 1}
    return DriftTrace(
        layers=layers,
        numel=numel,
        steps=tuple(StepObservation(step=s, lr=1.0, drift={n: drift for n in layers}) for s in range(1, steps + 1)),
    )


def test_interval_policy_accounting():
    trace = constant_trace(steps=100)
    r = simulate_interval(trace, 10)
    assert r.events == 10
    assert r.bytes_written == 10 * 41 * BYTES_PER_PARAM
    assert r.max_staleness == 9
    assert r.mean_weighted_staleness == pytest.approx(4.5)  # 0..9 uniformly
    assert r.mean_unsaved_drift == pytest.approx(4.5)  # drift 1 per step, reset at each save


def test_never_policy_loses_everything_since_the_start():
    r = simulate_config(constant_trace(steps=50), NeverConfig(), label="never")
    assert r.bytes_written == 0 and r.events == 0 and r.max_staleness == 50


def test_layercheck_on_uniform_drift_matches_interval_at_the_same_pace():
    trace = constant_trace(steps=200, drift=1.0)
    config = LayerCheckConfig(k0=10.0, k0_embed=10.0, warmup_steps=0, threshold_schedule="constant")
    c = compare(trace, config, label="lc", eval_from=0)
    # base at step 1, then every layer reaches the threshold every 10 steps (11, 21, ... 191):
    # the same bytes and freshness as a full checkpoint every 10 steps
    assert c.result.events == 20
    assert c.matched_staleness.policy == "full/10" and c.matched_staleness.interval == 10
    assert c.result.interval is None
    assert c.bytes_vs_staleness_match == pytest.approx(1.0)


def test_match_interval_finds_the_closest_interval():
    trace = constant_trace(steps=300)
    matched = match_interval(trace, 14.5, lambda r: r.mean_weighted_staleness)
    assert matched.interval == 30 and matched.policy == "full/30"


def test_sweep_spans_the_trade_off():
    trace = synthetic_trace(blocks=4, steps=600, seed=1)
    curve = sweep_k0(trace, LayerCheckConfig(warmup_steps=50), [2.5e-4, 1e-3, 4e-3], eval_from=50)
    written = [c.result.bytes_written for c in curve]
    stale = [c.result.mean_weighted_staleness for c in curve]
    assert written == sorted(written, reverse=True)  # larger K0: fewer bytes ...
    assert stale == sorted(stale)  # ... staler recovery
    for c in curve:
        assert c.result.max_staleness <= 1000


@pytest.mark.parametrize("form", ["json", "csv"])
def test_trace_round_trips(form):
    trace = synthetic_trace(blocks=2, steps=20, seed=3)
    text = json.dumps(trace.to_json()) if form == "json" else trace.to_csv()
    assert DriftTrace.parse(text) == trace


@pytest.mark.parametrize(
    "text,message",
    [
        ("step,lr,embed\n1,0.1,0.2\n", "numel"),
        ("step,lr,embed\nnumel,,10\n1,0.1\n", "line 3"),
        ("step,lr,embed\nnumel,,10\n2,0.1,0.2\n1,0.1,0.2\n", "steps must increase"),
        ("{not json", "invalid JSON"),
        ('{"layers": []}', "not a drift trace"),
        ("hello", "header"),
    ],
)
def test_bad_traces_are_reported(text, message):
    with pytest.raises(TraceFormatError, match=message):
        DriftTrace.parse(text)


def test_cli_replays_a_recorded_trace_as_json(tmp_path, capsys):
    path = tmp_path / "trace.csv"
    path.write_text(synthetic_trace(blocks=3, steps=400, seed=2).to_csv())
    assert main(["simulate", "--trace", str(path), "--warmup", "50", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    comparison = report["comparisons"][0]
    assert report["trace"] == {
        "layers": 6,
        "steps": 400,
        "params": sum(synthetic_trace(blocks=3, steps=1).numel.values()),
    }
    assert comparison["result"]["events"] >= 1
    assert comparison["result"]["persists"]["embed"] >= 1
    assert comparison["matched_staleness"]["policy"].startswith("full/")
    assert comparison["bytes_vs_full_matched_staleness"] > 0


def test_cli_sweep_prints_a_table(capsys, tmp_path):
    out = tmp_path / "t.json"
    assert (
        main(
            [
                "simulate",
                "--steps",
                "300",
                "--blocks",
                "2",
                "--warmup",
                "30",
                "--sweep",
                "5e-4,2e-3",
                "--write-trace",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "layercheck k0=0.0005" in text and "layercheck k0=0.002" in text and "full @ same stal" in text
    assert len(DriftTrace.parse(out.read_text()).steps) == 300


def test_cli_bad_config_exits_with_the_field(capsys):
    with pytest.raises(SystemExit, match="policy.smax"):
        main(["simulate", "--smax", "0"])
    with pytest.raises(SystemExit, match="policy.name"):
        main(["simulate", "--policy", "sometimes"])


def test_cli_baseline_policy(capsys):
    assert main(["simulate", "--policy", "interval", "--interval", "50", "--steps", "300", "--blocks", "2"]) == 0
    assert "interval" in capsys.readouterr().out


def test_cli_drift_optimal_policy_is_compared_like_layercheck(capsys):
    assert (
        main(
            [
                "simulate",
                "--policy",
                "drift-optimal",
                "--period",
                "40",
                "--steps",
                "400",
                "--blocks",
                "3",
                "--warmup",
                "40",
                "--spread",
                "1.0",
                "--json",
            ]
        )
        == 0
    )
    (comparison,) = json.loads(capsys.readouterr().out)["comparisons"]
    assert comparison["result"]["policy"] == "drift-optimal period=40"
    assert comparison["result"]["max_staleness"] <= 1000 and comparison["bytes_vs_full_matched_drift"] > 0


def test_cli_prints_the_default_schedule_beside_the_oracle_with_peak_bytes(capsys):
    assert main(["simulate", "--steps", "400", "--blocks", "3", "--period", "20", "--json"]) == 0
    (comparison,) = json.loads(capsys.readouterr().out)["comparisons"]
    assert comparison["result"]["policy"] == "staggered period=20"
    full = sum(synthetic_trace(blocks=3, steps=1).numel.values()) * BYTES_PER_PARAM
    assert 0 < comparison["result"]["peak_step_bytes"] < full
    assert comparison["matched_drift"]["peak_step_bytes"] == full  # a whole checkpoint at each save
    # storage at each one's own mean rate: most of a checkpoint waits for it after a full save
    assert 0 < comparison["result"]["peak_backlog_bytes"] < comparison["matched_drift"]["peak_backlog_bytes"]
    assert comparison["matched_drift"]["peak_backlog_bytes"] > 0.9 * full
    assert main(["simulate", "--steps", "400", "--blocks", "3", "--period", "20", "--spread-phases", "--json"]) == 0
    (spread,) = json.loads(capsys.readouterr().out)["comparisons"]
    assert spread["result"]["policy"] == "staggered period=20 spread"
    assert spread["result"]["bytes_written"] == comparison["result"]["bytes_written"]
    assert spread["result"]["peak_backlog_bytes"] < comparison["result"]["peak_backlog_bytes"]
    assert 0.9 <= comparison["bytes_vs_oracle_matched_drift"] <= 1.1
    assert main(["simulate", "--steps", "300", "--blocks", "2", "--policy", "interval", "--interval", "30"]) == 0
    assert "oracle @ same drift" in capsys.readouterr().out


def test_the_peak_backlog_is_what_waits_where_storage_writes_the_mean_per_step():
    assert peak_backlog([]) == 0.0
    assert peak_backlog([0, 0, 0]) == 0.0
    assert peak_backlog([5, 5, 5]) == 0.0  # as fast as it comes
    assert peak_backlog([12, 0, 0, 0]) == 9.0  # a burst: 3 a step drained
    assert peak_backlog([6, 0, 6, 0]) == 3.0  # the same bytes spread out
    assert peak_backlog([0, 0, 0, 6, 0, 6, 0]) == 3.0  # a warm-up that saves nothing does not count
