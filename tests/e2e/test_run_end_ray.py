"""How a run ends, on a real local Ray: a run ends with its trained model in the
store, a writer actor killed mid-run is replaced without losing what the ranks held, storage
that breaks mid-run stops the run with the bound's breach reported (and an end-of-run write
error does not crash the driver). Ctrl-C, a killed driver and an S3 outage, each followed by
``--resume``: tests/e2e/test_stop_and_resume_run.py."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from layercheck.orchestrator.offline.exporter import export
from layercheck.orchestrator.runtime.driver import train
from layercheck.orchestrator.runtime.run_summary import format_summary, summarize
from layercheck.orchestrator.store.layer_store import DRIFT_TRACE_FILE, LayerStore
from layercheck.orchestrator.store.manifest import LAYERS_DIR
from layercheck.policies.configs import LayerCheckConfig
from tests.support.faults import FaultPlan, injected
from tests.support.ray_runs import demo_config
from tests.support.store_helpers import newest_steps

pytestmark = pytest.mark.slow


def config(tmp_path, name, steps=12, policy=None, **overrides):
    """The demo, ``steps`` long, without an injected worker failure."""
    return demo_config(tmp_path, name, steps=steps, policy=policy, **{"fault.kill_at_step": 0, **overrides})


def hf_weights(tmp_path, storage, name):
    out = export(str(storage), fmt="hf", out=tmp_path / f"export-{name}")
    return load_file(str(next(Path(out).glob("*.safetensors"))))


def test_a_finished_run_exports_its_trained_model_even_after_its_writer_died(local_ray, clean_run, tmp_path):
    """The reference (the ``clean_run`` session fixture, failure-free) persists every layer every
    step, so its step-12 composite is the trained model. The run under test saves only its base at
    step 2 (thresholds it never reaches), and its writer actor is killed after step 5 (the test
    injector's ``kill_writer_at_step``): the final state must still reach the store, through a
    replacement writer, and export to the reference's weights."""
    reference = clean_run
    assert reference.config.steps == 12 and reference.status["account"]["failures"] == 0
    with injected(FaultPlan(kill_writer_at_step=5)):
        run = train(config(tmp_path, "final", policy=LayerCheckConfig(warmup_steps=2, k0=1e6, k0_embed=1e6, smax=1000)))
    assert run.error is None, run.error
    assert run.status["writers_replaced"] == 1 and run.status["lost_versions"] == 0
    assert newest_steps(str(tmp_path / "final")) == {layer: 12 for layer in run.layer_numel}
    summary = summarize(run)
    assert "writers replaced" in format_summary(summary)
    trained, exported = (
        hf_weights(tmp_path, reference.config.storage_uri, "ref"),
        hf_weights(tmp_path, tmp_path / "final", "final"),
    )
    assert trained.keys() == exported.keys()
    for key in trained:
        torch.testing.assert_close(exported[key], trained[key], rtol=1e-5, atol=1e-6, msg=key)


def test_storage_that_breaks_mid_run_stops_the_run_with_the_breach_reported(local_ray, tmp_path):
    """After step 4 the store's layer directory turns into a file (every shard write fails, like a
    read-only or full disk) and drift_trace.json into a directory (the driver's last write fails):
    the run stops soon after staleness passes smax, says why, and still prints its summary."""
    storage = tmp_path / "broken"
    broken = {}

    def break_storage(status):
        if status["step"] >= 4 and not broken:
            broken["committed"] = {v.version_id for v in LayerStore.open(str(storage)).versions()}
            (storage / LAYERS_DIR).rename(storage / "layers.moved")
            (storage / LAYERS_DIR).write_text("not a directory")
            (storage / DRIFT_TRACE_FILE).mkdir()
            broken["at"] = status["step"]

    cfg = config(
        tmp_path,
        "broken",
        steps=400,
        policy=LayerCheckConfig(warmup_steps=2, k0=1e6, k0_embed=1e6, smax=3),
    )
    result = train(cfg, on_progress=break_storage, poll_s=0.2)
    status = result.status
    assert broken, "the run ended before the storage was broken"
    breach = status["staleness_breach"]
    assert breach is not None and breach["action"] == "stop" and breach["staleness"] > 3 + 1
    assert status["step"] < 400 and "staleness bound" in (result.error or "")
    assert status["write_failures"] > 0
    assert any(DRIFT_TRACE_FILE in error for error in result.end_errors)
    text = format_summary(summarize(result))
    assert "STALENESS BOUND BROKEN" in text and "end-of-run error" in text
    assert "stored at the end" in text and "NOT the final state" in text  # (the manifest is still readable)
    # what was committed before the storage broke is still in the manifest
    versions = LayerStore.open(str(storage)).versions()
    assert broken["committed"] <= {v.version_id for v in versions}
