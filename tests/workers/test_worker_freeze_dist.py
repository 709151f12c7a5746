"""model.freeze and optim.layer_lr_decay on real DeepSpeed (gloo, CPU, 2 ranks) at ZeRO-0, 2 and 3."""

from __future__ import annotations

import pytest

from tests.support import freeze_jobs
from tests.support.dist_harness import run_jobs

TRAINED = ["block.2", "block.3", "norm", "lm_head"]


STAGES = [0, 2, 3]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every stage's job, one after another in one 2-rank spawn."""
    jobs = [(freeze_jobs.frozen_job, (stage, str(tmp_path_factory.mktemp(f"ds-zero{stage}")))) for stage in STAGES]
    return dict(zip(STAGES, run_jobs(2, jobs)))


@pytest.fixture(scope="module", params=STAGES, ids=lambda s: f"zero{s}")
def job(request, results):
    return request.param, results[request.param]


@pytest.mark.slow
def test_frozen_layers_are_not_layercheck_layers(job):
    _, results = job
    for r in results:
        assert r["layers"] == r["meta_layers"] == r["layout_layers"] == TRAINED
        assert r["frozen_params"] and all(
            n.startswith(("model.embed_tokens", "model.layers.0.", "model.layers.1.")) for n in r["frozen_params"]
        )
        assert not any(g.startswith(("embed/", "block.0/", "block.1/")) for g in r["groups"])


@pytest.mark.slow
def test_frozen_weights_never_change_and_equal_a_fresh_build(job):
    _, results = job
    for r in results:
        assert r["frozen_unchanged"] and r["frozen_equal_fresh_build"] and r["trained_changed"]


@pytest.mark.slow
def test_snapshot_restore_reproduces_the_trajectory_with_frozen_layers(job):
    _, results = job
    for r in results:
        assert r["restored_equals_snapshot"]
        first, second = r["losses"]
        assert first == second
        assert r["probe_loss_finite"]
        assert r["groups_follow_load_state_dict"]


@pytest.mark.slow
def test_each_layer_trains_at_its_decayed_lr(job):
    _, results = job
    expected_scale = {"block.2": 0.5, "block.3": 1.0, "norm": 1.0, "lm_head": 1.0}
    for r in results:
        for name, (lr, want, scale) in r["lr"].items():
            assert scale == expected_scale[name.split("/")[0]], name
            assert lr == pytest.approx(want, rel=1e-12), name
