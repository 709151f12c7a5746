"""An S3 outage during a real ``layercheck train`` (a local Ray; storage on the loopback S3
server, the moto fixture): the writes fail, the staleness bound's breach is reported and the run
stops cleanly with its summary; what was committed before the outage stays; once the outage is
over, ``--resume`` continues the run to its end."""

import pytest

from layercheck.orchestrator.core.run_config import check_model, load_run_config
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.policies.plan import newest_recoverable_step
from tests.support.s3_server import FAST_FAIL
from tests.support.train_proc import start_train

pytestmark = pytest.mark.slow
#: The run under the outage is long enough never to end before its breach (the outage comes once
#: every layer has a committed version: at step 35 once on a loaded machine, and once the writes
#: were so far behind that a 60-step run ended first); it stops at the breach. The resume trains
#: ``MORE`` steps past the newest recoverable one, not the whole schedule.
STEPS = 400
MORE = 6


def test_an_s3_outage_mid_run_stops_it_with_the_breach_and_resume_continues(tmp_path, ray_tmp, s3):
    uri = s3.uri("runs/outage", **FAST_FAIL)
    # the run under the outage does not retry a failed request: each of the writes it queued up
    # fails at once (the outage shows in the first), where FAST_FAIL's retry would take its
    # backoff for each; the resume, after the outage, retries as FAST_FAIL says
    no_retry = s3.uri("runs/outage", **{**FAST_FAIL, "retry_max_attempts": "1"})
    settings = (
        f"steps={STEPS}",
        f"optim.total_steps={STEPS}",
        "policy.warmup_steps=2",
        "policy.period=3",  # every layer saved every 3 steps, so a few failed writes break smax
        "policy.smax=3",
        "fault.kill_at_step=0",
        "metrics.port=0",
        "log_every=1",
    )
    layers = set(check_model(load_run_config("examples/demo.toml").model).numel)
    run = start_train(tmp_path, *settings, f"storage={no_retry}", ray_tmp=ray_tmp)
    step = run.wait_for_step(8)
    while {v.layer for v in LayerStore.open(uri).versions()} != layers:  # a recoverable store first
        step = run.wait_for_step(step + 1)
    committed = {v.version_id for v in LayerStore.open(uri).versions()}
    s3.proxy.cut()
    out = run.finish(timeout=600)
    err = run.stderr
    assert run.proc.returncode == 1, err[-3000:]
    assert "STALENESS BOUND BROKEN" in out and "staleness bound" in out, out[-3000:]
    assert "--resume" in err, err[-3000:]  # the resume command of a stopped run
    assert "NETWORK_CONNECTION" in err and "lc-dummy" not in err + out  # the cause; no credentials

    s3.proxy.restore()
    store = LayerStore.open(uri)
    assert committed and committed <= {v.version_id for v in store.versions()}
    newest = newest_recoverable_step({v.layer for v in store.versions()}, store.manifest().refs())
    end = newest + MORE
    resumed = start_train(tmp_path, *settings, f"steps={end}", f"storage={uri}", ray_tmp=ray_tmp, args=("--resume",))
    out = resumed.finish(timeout=600)
    err = resumed.stderr
    assert resumed.proc.returncode == 0, err[-3000:]
    assert f"continuing at step {newest + 1} of {end}" in err, err[-3000:]
    final = {}
    for version in LayerStore.open(uri).versions():
        final[version.layer] = max(version.step, final.get(version.layer, 0))
    assert set(final.values()) == {end}, out[-2000:]
