"""The matched variants' intervals (``layercheck.bench.matched``): at LayerCheck's freshness and at its bytes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from layercheck.bench.formulas import bytes_matched_interval, checkpoints_in, trace_of
from layercheck.bench.matched import bytes_settings, describe_bytes_match, matched_settings
from layercheck.bench.presets import preset
from layercheck.bench.strategies import default_strategies, select

# a 30-step run whose warm-up W = 10: full checkpoints count from step 10 on
SINCE, STEPS = 10, 30


def test_the_interval_whose_checkpoints_from_w_write_the_target_bytes():
    match = bytes_matched_interval(per_checkpoint=100.0, target=300.0, since=SINCE, steps=STEPS)
    # N = 7 saves at 14, 21, 28; N = 6 four times, N = 8 twice
    assert (match.interval, match.checkpoints) == (7, 3) and match.reason == ""
    # the closest count wins, and of equal counts the shortest interval (the freshest baseline)
    near = bytes_matched_interval(per_checkpoint=100.0, target=320.0, since=SINCE, steps=STEPS)
    assert near.interval == 7
    # one checkpoint: 16 is the shortest interval with a single multiple in [10, 30]
    one = bytes_matched_interval(per_checkpoint=100.0, target=100.0, since=SINCE, steps=STEPS)
    assert (one.interval, one.checkpoints) == (16, 1)
    assert checkpoints_in(9, SINCE, STEPS) == 2 and checkpoints_in(10, SINCE, STEPS) == 3  # not monotonic in N


def test_more_than_a_checkpoint_a_step_gives_every_step():
    match = bytes_matched_interval(per_checkpoint=100.0, target=1e6, since=SINCE, steps=STEPS)
    assert (match.interval, match.checkpoints) == (1, STEPS - SINCE + 1)


def test_less_than_one_checkpoint_gives_no_interval_and_says_why():
    match = bytes_matched_interval(per_checkpoint=100.0, target=99.0, since=SINCE, steps=STEPS)
    assert match.interval is None and match.checkpoints == 0 and "less than one full checkpoint" in match.reason
    unmeasured = bytes_matched_interval(per_checkpoint=0.0, target=99.0, since=SINCE, steps=STEPS)
    assert unmeasured.interval is None and "no full checkpoint size" in unmeasured.reason


def _raw(bytes_written: float, events: int = 1) -> dict:
    return {"bytes_written": bytes_written, "events": events}


@pytest.fixture()
def workload():
    return preset("tiny", steps=STEPS, failures=(20,), layercheck_warmup=SINCE, interval=5)


def _strategies(workload, names):
    return select(default_strategies(workload.strategy), names)


def test_each_baseline_matches_the_captures_bytes_with_its_own_checkpoint_size(workload):
    strategies = _strategies(workload, ["layercheck", "layercheck+capture", "full", "full-resume", "diff"])
    results = {
        "layercheck": _raw(250.0, 9),
        "layercheck+capture": _raw(300.0, 9),  # the capture's writes are LayerCheck's bytes too
        "full": _raw(1200.0, 6),  # 200 B a DeepSpeed checkpoint
        "full-resume": _raw(600.0, 6),  # 100 B a LayerStore checkpoint
        "diff": _raw(5000.0, 30),
    }
    out = bytes_settings(results, workload, strategies)
    assert out["bytes_target"] == "layercheck+capture" and out["target_bytes"] == 300.0
    assert out["bytes_per_checkpoint"] == {"full": 200.0, "full-resume": 100.0}
    # full: 1.5 checkpoints' worth -> one or two equally close, the shortest interval: 8 (saves at 16, 24)
    assert out["bytes"] == {"full": 8, "full-resume": 7}
    assert out["bytes_skipped"] == {} and out["bytes_clipped_to_min_interval"] is None
    text = describe_bytes_match(out)
    assert "`full@bytes` every **8** steps" in text and "`layercheck+capture` wrote" in text
    assert "floored" not in text


def test_without_capture_the_target_is_layercheck_and_a_too_small_one_is_skipped(workload):
    strategies = _strategies(workload, ["layercheck", "full", "full-resume"])
    results = {"layercheck": _raw(120.0, 9), "full": _raw(1200.0, 6), "full-resume": _raw(600.0, 6)}
    out = bytes_settings(results, workload, strategies)
    assert out["bytes_target"] == "layercheck"
    assert out["bytes"] == {"full-resume": 16}  # one checkpoint (at 16), the shortest interval with one
    assert "less than one full checkpoint" in out["bytes_skipped"]["full"]
    assert "no `full@bytes`: the target" in describe_bytes_match(out)


def test_the_floor_binds_the_byte_matched_interval_and_says_so(workload):
    floored = replace(workload, strategy=replace(workload.strategy, min_matched_interval=5))
    strategies = _strategies(floored, ["layercheck", "full-resume"])
    out = bytes_settings({"layercheck": _raw(1e6), "full-resume": _raw(600.0, 6)}, floored, strategies)
    assert out["bytes"] == {"full-resume": 5} and out["bytes_clipped_to_min_interval"] == 5
    assert out["bytes_unfloored"] == {"full-resume": 1}  # LayerCheck wrote more than a checkpoint a step
    assert "1 floored at `min_matched_interval` = 5, so it writes fewer bytes" in describe_bytes_match(out)


def test_matched_settings_hold_the_freshness_and_the_byte_intervals(workload):
    numel = {"embed": 500, "block.0": 500}
    trace = trace_of(
        numel, {t: {n: 0.1 for n in numel} for t in range(1, STEPS + 1)}, {t: 1e-3 for t in range(1, STEPS + 1)}
    )
    lc = {**_raw(300.0, 9), "freshness": {"mean_weighted_staleness": 3.0, "mean_unsaved_drift": 0.3}}
    results = {"none": {"trace": trace.to_json()}, "layercheck": lc, "full-resume": _raw(600.0, 6)}
    out = matched_settings(results, workload, _strategies(workload, ["layercheck", "full-resume"]))
    assert out["staleness"] >= 1 and out["drift"] >= 1 and out["clipped_to_min_interval"] is None
    assert out["bytes"] == {"full-resume": 7} and out["bytes_target"] == "layercheck"
