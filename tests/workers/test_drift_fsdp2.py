"""Every drift probe on FSDP2's DTensor masters (real ``fully_shard`` on 2 gloo ranks, the tiny Llama
with uneven shards): per layer, each reads exactly the L1 of this rank's local-shard change, also
after the parameters' local tensors were swapped under probes built before the first forward; the
fused step in place of torch's AdamW and DriftAdamW (the built-in loop's layer-aligned groups,
every ``drift_step``) leave parameters and moments bit-equal to torch's own AdamW step; no probe
works through DTensor dispatch. (The runs: tests/support/fsdp2_drift_jobs.py.)"""

from __future__ import annotations

import pytest

from layercheck.policies.configs import drift_measured
from layercheck.workers.drift.hooks import FUSED_IN_PLACE
from tests.support import fsdp2_drift_jobs as jobs
from tests.support.dist_harness import run_jobs

RUNS = {run.name: run for run in jobs.RUNS}


@pytest.fixture(scope="module")
def ranks():
    """Each rank's results, by run name: every run one after another in one 2-rank spawn."""
    (results,) = run_jobs(2, [(jobs.drift_probes_job, ())])
    return results


@pytest.mark.slow
def test_every_probe_reads_each_layers_local_shard_change_exactly(ranks):
    for rank, runs in enumerate(ranks):
        for name, r in runs.items():
            run = RUNS[name]
            # the probes were built before the first forward; every local tensor was swapped since, twice
            assert r["swapped"] == [r["params"]] * len(jobs.SWAPPED_BEFORE), (rank, name)
            for step, s in enumerate(r["steps"], start=1):
                for kind in run.probes:
                    assert s["numel"][kind] == r["local_numel"], (rank, name, kind)
                    read = s["read"][kind]
                    if not drift_measured(step, run.every):
                        assert read is None, (rank, name, kind, step)
                        continue
                    assert all(v > 0 for v in s["exact"].values()), (rank, name, step)
                    assert read == pytest.approx(s["exact"], rel=1e-5), (rank, name, kind, step)


@pytest.mark.slow
def test_each_kind_resolves_as_it_does_for_plain_tensors(ranks):
    runs = ranks[0]
    assert runs["foreach, fused probe"]["probes"]["fused"][:2] == ["StepHookProbe", FUSED_IN_PLACE]
    assert runs["foreach, auto"]["probes"]["auto"][:2] == ["StepHookProbe", FUSED_IN_PLACE]
    assert runs["foreach, step_hooks"]["probes"]["step_hooks"][:2] == ["StepHookProbe", "step_hooks"]
    assert runs["fused=True"]["probes"]["auto"][0] == "SnapshotDiffProbe"
    refusal = runs["fused=True"]["refused"]["fused"]
    assert "fused=True" in refusal and "'step_hooks'" in refusal and "\n" not in refusal
    assert runs["DriftAdamW auto"]["probes"]["auto"] == ["DriftProbe", None, "foreach"]
    assert runs["DriftAdamW foreach"]["probes"]["optimizer"] == ["DriftProbe", None, "foreach"]
    assert runs["DriftAdamW fused"]["probes"]["fused"] == ["DriftProbe", None, "fused"]


@pytest.mark.slow
def test_the_fused_step_and_drift_adamw_are_torchs_adamw_bit_for_bit(ranks):
    for rank, runs in enumerate(ranks):
        for name, r in runs.items():
            if RUNS[name].same_as is not None:
                assert r["differs"] == [], (rank, name, RUNS[name].same_as)


@pytest.mark.slow
def test_no_probe_works_through_dtensor_dispatch(ranks):
    """The probes read and step local tensors: a step the fused step or DriftAdamW takes runs no
    DTensor op; a probe around the user's own step adds none to it; a collect runs none."""
    for rank, runs in enumerate(ranks):
        assert all(s["step_ops"] for s in runs["torch foreach"]["steps"]), "torch's own step dispatches through DTensor"
        for name, r in runs.items():
            run = RUNS[name]
            assert [s["collect_ops"] for s in r["steps"]] == [0] * jobs.STEPS, (rank, name)
            step_ops = [s["step_ops"] for s in r["steps"]]
            if run.local_step:
                assert step_ops == [0] * jobs.STEPS, (rank, name)
            elif run.same_as is not None:
                assert step_ops == [s["step_ops"] for s in runs[run.same_as]["steps"]], (rank, name)
