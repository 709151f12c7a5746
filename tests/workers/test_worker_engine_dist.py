"""Real DeepSpeed (gloo, CPU) on 1-2 ranks: drift probe, snapshot/restore round trip, partial restore.

One job per configuration checks every property (see tests/support/worker_jobs.py), the jobs of
one world size in one spawn; the assertions are here.
"""

from __future__ import annotations

import math

import pytest

from tests.support import worker_jobs
from tests.support.dist_harness import run_jobs

# (zero stage, precision, world size, gradient accumulation)
CONFIGS = [
    (0, "fp32", 2, 1),
    (0, "bf16", 2, 1),
    (1, "fp32", 2, 1),
    (1, "bf16", 2, 2),
    (2, "fp32", 2, 2),
    (2, "bf16", 2, 1),
    (3, "fp32", 2, 1),
    (3, "bf16", 2, 2),
    (0, "fp32", 1, 2),
    (0, "bf16", 1, 1),
    (3, "fp32", 1, 1),
    (3, "bf16", 1, 2),
]


@pytest.fixture(scope="module")
def results():
    """Every configuration's job, those of one world size one after another in one spawn."""
    out = {}
    for world in sorted({c[2] for c in CONFIGS}):
        configs = [c for c in CONFIGS if c[2] == world]
        jobs = [
            (worker_jobs.drift_and_roundtrip_job, (stage, precision, accum)) for stage, precision, _, accum in configs
        ]
        out.update(zip(configs, run_jobs(world, jobs)))
    return out


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"zero{c[0]}-{c[1]}-w{c[2]}-ga{c[3]}")
def job(request, results):
    return request.param, results[request.param]


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-9)


@pytest.mark.slow
def test_param_groups_follow_the_layer_map(job):
    _, results = job
    for r in results:
        names = [name for name, _, _ in r["groups"]]
        assert names == [
            "embed/decay",
            "block.0/decay",
            "block.0/no_decay",
            "block.1/decay",
            "block.1/no_decay",
            "norm/no_decay",
            "lm_head/decay",
        ]
        assert all(wd == (0.1 if name.endswith("/decay") else 0.0) for name, wd, _ in r["groups"])


@pytest.mark.slow
def test_owned_elements_partition_each_layer(job):
    (stage, _, world, _), results = job
    layer_numel = results[0]["layer_numel"]
    for name, numel in layer_numel.items():
        assert sum(r["numel"][name] for r in results) == numel
        for r in results:
            assert r["needed_covers_layer"][name] == (numel if stage == 0 else r["numel"][name])


@pytest.mark.slow
def test_drift_equals_snapshot_and_diff(job):
    _, results = job
    for r in results:
        assert r["local_drift"] and r["global_drift"]
        for layer, probe, reference in r["local_drift"]:
            assert reference > 0, layer
            assert _close(probe, reference), (layer, probe, reference)
        for layer, probe, reference in r["global_drift"]:
            assert _close(probe, reference), (layer, probe, reference)


@pytest.mark.slow
def test_sampled_drift_is_exact_on_the_steps_it_measures_and_absent_on_the_others(job):
    _, results = job
    for r in results:
        first = r["sampled"][0][0]
        for step, measured, l1, diff_measured, diff_l1, reference in r["sampled"]:
            expected = step == first or (step - 1) % 2 == 0  # the step after the reset, then the grid
            assert measured is expected and diff_measured is expected, (step, measured, diff_measured)
            if not expected:
                assert l1 == {} and diff_l1 == {}, step
                continue
            for layer, value in reference.items():
                assert _close(l1[layer], value) and _close(diff_l1[layer], value), (step, layer, l1, diff_l1, value)
        assert any(m for _, m, *_ in r["sampled"][1:]) and not all(m for _, m, *_ in r["sampled"]), r["sampled"]


@pytest.mark.slow
def test_each_probe_says_what_it_is_and_times_its_own_work_on_the_steps_it_measures(job):
    _, results = job
    for r in results:
        for (step, measured, *_), (optimizer, diff) in zip(r["sampled"], r["probe_costs"]):
            assert optimizer["probe"] == "optimizer (foreach)" and diff["probe"] == "snapshot_diff"
            assert optimizer["measured"] is measured and diff["measured"] is measured, step
            if measured:  # the copies and norms beside the update; the diff and the next copy
                assert optimizer["seconds"] > 0 and diff["seconds"] > 0, (step, optimizer, diff)
            else:  # the optimizer did not count this step (the diff probe copied its next reference)
                assert optimizer["seconds"] == 0.0, (step, optimizer)


@pytest.mark.slow
def test_forward_reads_restored_weights(job):
    _, results = job
    for r in results:
        at_snapshot, after_restore = r["loss_at_snapshot"]
        assert after_restore == at_snapshot
        assert r["restored_equals_snapshot"]


@pytest.mark.slow
def test_restore_reproduces_the_trajectory(job):
    _, results = job
    for r in results:
        first, second = r["losses"]
        assert first == second
        assert r["drifts"][0] == r["drifts"][1]
        assert r["end_state_equal"]


@pytest.mark.slow
def test_partial_restore_touches_only_chosen_layers(job):
    _, results = job
    for r in results:
        assert all(r["mixed"].values()), r["mixed"]
        assert all(r["mixed_differs_from_current"].values())
