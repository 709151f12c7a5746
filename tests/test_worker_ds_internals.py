"""Each private-DeepSpeed wrapper in workers/ds_internals.py, checked against public helpers.

If a DeepSpeed upgrade moves an attribute, these tests say which wrapper broke.
"""

from __future__ import annotations

import pytest

from tests import worker_jobs
from tests.dist_harness import run_ranks
from workers import ds_internals


def test_missing_attribute_is_a_loud_named_error():
    class Engine:
        pass

    with pytest.raises(ds_internals.DeepSpeedInternalsError, match="basic_optimizer"):
        ds_internals.client_optimizer(Engine())


@pytest.mark.slow
@pytest.mark.parametrize("stage, precision", [(0, "bf16"), (2, "bf16"), (3, "bf16")])
def test_wrappers_agree_with_deepspeed(stage, precision):
    results = run_ranks(worker_jobs.internals_job, 2, stage, precision)
    for r in results:
        assert r["client_is_drift_adamw"]
        assert r["refresh_reaches_model"]
        if stage == 0:
            assert r["pairs_cover_params"] and r["masters_match_model"] and r["masters_are_fp32"]
        else:
            assert r["fragment_values_match_public_helper"]
    if stage:
        for name, numel in results[0]["numel"].items():
            assert sum(r["coverage"][name] for r in results) == numel, name
    if stage == 3:
        assert all(r["sub_groups_cover_groups"] for r in results)
