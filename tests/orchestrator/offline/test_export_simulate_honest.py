"""Exports and replays say what they are: an HF export ships the run's
tokenizer; ``--step`` past the run is refused, not mislabelled; ``simulate --trace`` on a run's
own trace replays the run's own policy, and refuses a trace that ends before its warm-up."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import transformers

from layercheck.orchestrator.cli.main import main
from layercheck.orchestrator.store.layer_store import RUN_CONFIG_FILE
from layercheck.policies.configs import policy_config
from layercheck.policies.trace import synthetic_trace
from tests.orchestrator.offline.test_export import run  # noqa: F401 - the fixture: a store of a tiny model at steps 10 and 20
from tests.support import composite_jobs as jobs

TOKENIZER = Path(__file__).resolve().parents[3] / "examples" / "data" / "sft-tokenizer"


def test_hf_export_ships_the_runs_tokenizer(run, tmp_path):  # noqa: F811
    uri, _, _ = run
    config = jobs.run_config()
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, tokenizer=str(TOKENIZER)))
    jobs.write_run_json(uri, config)
    out = tmp_path / "hf"
    assert main(["export", uri, "--format", "hf", "--out", str(out)]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(str(out))
    original = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER))
    assert exported("hello world")["input_ids"] == original("hello world")["input_ids"]


def test_hf_export_with_a_missing_tokenizer_fails_before_writing(run, tmp_path, capsys):  # noqa: F811
    uri, _, _ = run
    config = jobs.run_config()
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, tokenizer=str(tmp_path / "gone")))
    jobs.write_run_json(uri, config)
    assert main(["export", uri, "--format", "hf", "--out", str(tmp_path / "hf")]) == 2
    assert "tokenizer" in capsys.readouterr().out and not (tmp_path / "hf").exists()


def test_export_past_the_newest_step_is_refused_not_mislabelled(run, tmp_path, capsys):  # noqa: F811
    uri, _, _ = run
    assert main(["export", uri, "--format", "deepspeed", "--step", "100", "--out", str(tmp_path / "ds")]) == 2
    out = capsys.readouterr().out
    assert "--step 100 is past the newest recoverable step 20" in out and not (tmp_path / "ds").exists()


def _run_dir_with_trace(tmp_path, steps: int, policy: dict) -> Path:
    trace = synthetic_trace(blocks=2, steps=steps, peak_lr=1e-3, spread=0.3, seed=0, warmup=5)
    (tmp_path / "drift_trace.json").write_text(json.dumps(trace.to_json()))
    (tmp_path / RUN_CONFIG_FILE).write_text(json.dumps({"name": "r", "policy": policy}))
    return tmp_path / "drift_trace.json"


def test_simulate_replays_the_runs_own_policy(tmp_path, capsys):
    path = _run_dir_with_trace(
        tmp_path,
        120,
        {
            "name": "layercheck",
            "k0": 0.005,
            "k0_embed": 0.05,
            "smax": 40,
            "warmup_steps": 20,
            "threshold_schedule": "lr",
        },
    )
    assert main(["simulate", "--trace", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["eval_from"] == 20 and report["comparisons"][0]["result"]["policy"].startswith("layercheck k0=0.005")
    assert report["comparisons"][0]["result"]["max_staleness"] <= 40 + 1
    assert main(["simulate", "--trace", str(path), "--policy", "interval", "--interval", "10"]) == 0  # explicit wins


def test_simulate_refuses_a_trace_that_ends_before_the_warmup(tmp_path):
    path = _run_dir_with_trace(tmp_path, 48, {"name": "layercheck"})  # default warm-up 200: nothing saved
    with pytest.raises(SystemExit, match="ends at step 4[78], before the policy's warm-up"):
        main(["simulate", "--trace", str(path)])


def test_flags_override_fields_of_the_runs_policy(tmp_path, capsys):
    path = _run_dir_with_trace(tmp_path, 120, {"name": "layercheck", "warmup_steps": 20, "smax": 40})
    assert main(["simulate", "--trace", str(path), "--smax", "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["comparisons"][0]["result"]["max_staleness"] <= 11
    assert policy_config("layercheck", {"smax": 10}).smax == 10
