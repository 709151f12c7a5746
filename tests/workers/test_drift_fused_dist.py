"""The fused drift step inside real DeepSpeed (gloo, CPU, 2 ranks): per layer and step, the drift
it counts equals snapshot-and-diff over the same owned elements (ZeRO-0 windows, ZeRO 1-3 flat
partitions with padding, bf16 masters). On a GPU machine (``LAYERCHECK_TEST_DEVICE=cuda``) the
same on one NCCL rank, through the Triton kernel."""

from __future__ import annotations

import math

import pytest

from tests.support import worker_jobs
from tests.support.devices import cuda_requested
from tests.support.dist_harness import run_jobs

CONFIGS = [(0, "fp32"), (1, "bf16"), (2, "fp32"), (3, "bf16")]
WORLD = 1 if cuda_requested() else 2  # NCCL takes one rank per GPU; the GPU check has one


@pytest.fixture(scope="module")
def fused():
    """Every configuration's job, one after another in one spawn."""
    return dict(zip(CONFIGS, run_jobs(WORLD, [(worker_jobs.fused_drift_job, config) for config in CONFIGS])))


@pytest.mark.slow
@pytest.mark.parametrize("stage,precision", CONFIGS, ids=[f"zero{s}-{p}" for s, p in CONFIGS])
def test_fused_drift_equals_snapshot_and_diff(fused, stage, precision):
    results = fused[stage, precision]
    for r in results:
        assert r["drift_step"] == "fused"
        assert all(math.isfinite(loss) for loss in r["losses"])
        for step, layer, probed, reference in r["pairs"]:
            assert reference > 0, (step, layer)
            assert math.isclose(probed, reference, rel_tol=1e-5), (step, layer, probed, reference)
