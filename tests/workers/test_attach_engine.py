"""LayerCheck attached to a user's own DeepSpeed engine (real DeepSpeed, gloo, CPU; no Ray):
the user's optimizer and param groups, not aligned with layers, at every ZeRO stage; and the
errors a user meets before training."""

from __future__ import annotations

import math

import pytest

from layercheck.policies.layer_map import UnplacedParameterError, layer_map_from
from layercheck.workers.drift.hooks import FUSED_IN_PLACE
from tests.support import attach_jobs
from tests.support.dist_harness import run_jobs, run_ranks

CASES = [(0, "decay_groups"), (1, "ds_config"), (2, "decay_groups"), (3, "decay_groups"), (3, "ds_config")]
#: Each case's probes: ``auto`` (the fused step in place of the user's torch AdamW) and the two
#: that leave the user's step alone.
PROBES = ("auto", "step_hooks", "snapshot_diff")


@pytest.fixture(scope="module")
def results():
    """Every case's job with every probe, one after another in one 2-rank spawn."""
    jobs = [(case, probe) for case in CASES for probe in PROBES]
    return dict(zip(jobs, run_jobs(2, [(attach_jobs.user_engine_job, (*case, probe)) for case, probe in jobs])))


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"zero{c[0]}-{c[1]}")
def job(request, results):
    return request.param, results[(request.param, "auto")]


@pytest.mark.slow
@pytest.mark.parametrize("probe", PROBES)
def test_each_probe_measures_the_drift_exactly_per_layer(job, results, probe):
    case, _ = job
    expected = {"auto": FUSED_IN_PLACE, "step_hooks": "step_hooks", "snapshot_diff": "snapshot_diff"}[probe]
    for r in results[(case, probe)]:
        assert r["probe"] == expected
        for layer, probed, reference in r["drift"]:
            assert math.isclose(probed, reference, rel_tol=1e-5, abs_tol=1e-12), (layer, probed, reference)
        moved = {layer for layer, probed, _ in r["drift"] if probed > 0}  # WarmupDecayLR starts at lr 0
        assert moved == {layer for layer, _, _ in r["drift"]}


@pytest.mark.slow
def test_the_fused_step_in_place_of_the_users_adamw_is_bit_equal_to_it(job, results):
    """``auto`` steps the user's torch AdamW itself, with the drift counted inside the update: the
    trained state is the one torch's own step gives (under the probes that leave it alone), bit for bit."""
    case, _ = job
    for fused, hooked, untouched in zip(*(results[(case, probe)] for probe in PROBES)):
        assert fused["trained"] == hooked["trained"] == untouched["trained"]
        assert fused["losses"] == hooked["losses"] == untouched["losses"]


@pytest.mark.slow
def test_restore_into_a_user_engine_reproduces_the_trajectory(job):
    _, results = job
    for r in results:
        first, second = r["losses"]
        assert len(set(first)) == 3  # it trained
        assert first == second
        assert r["end_state_equal"]
        assert r["lr"][0] == pytest.approx(r["lr"][1])  # the user's schedule was moved back too


@pytest.mark.slow
def test_bad_input_fails_before_training_with_a_way_out():
    (r,) = run_ranks(attach_jobs.bad_input_job, 1)
    assert "'enc.weight'" in r["unplaced"] and "'dec.bias'" in r["unplaced"] and "layer_map=" in r["unplaced"]
    assert r["mapped"] == {"encoder": ["enc.weight", "enc.bias"], "decoder": ["dec.weight", "dec.bias"]}
    assert r["drift_layers"] == ["decoder", "encoder"]
    assert "SGD" in r["optimizer"] and "AdamW" in r["optimizer"]


def test_layer_map_from_a_dict_or_a_function():
    params = [("enc.0.weight", (4, 4)), ("enc.0.bias", (4,)), ("enc.head.weight", (4, 4)), ("dec.weight", (4, 4))]
    by_prefix = layer_map_from(params, {"enc": ["enc."], "head": ["enc.head."], "dec": ["dec."]})
    assert {layer.name: [p.name for p in layer.params] for layer in by_prefix.layers} == {
        "enc": ["enc.0.weight", "enc.0.bias"],
        "head": ["enc.head.weight"],
        "dec": ["dec.weight"],
    }
    by_fn = layer_map_from(params, lambda name: name.split(".")[0])
    assert by_fn.names == ("enc", "dec")
    with pytest.raises(UnplacedParameterError, match=r"'dec.weight'.*layer_map="):
        layer_map_from(params, {"enc": ["enc."]})
    with pytest.raises(TypeError, match="list of parameter-name prefixes"):
        layer_map_from(params, {"enc": "enc."})
