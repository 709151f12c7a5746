"""The built-in loop trains on SFT data on real DeepSpeed (ZeRO-3, gloo, 2 ranks)."""

import math
from pathlib import Path

import pytest

from tests.support import sft_jobs
from tests.support.dist_harness import run_jobs

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"
STEPS = 8


@pytest.fixture(scope="module")
def runs():
    """The padded and the packed job, one after the other in one 2-rank spawn."""
    data = (str(DATA / "sft.jsonl"), str(DATA / "sft-tokenizer"))
    jobs = [(sft_jobs.sft_loop_job, (*data, packing, STEPS)) for packing in (False, True)]
    return dict(zip((False, True), run_jobs(2, jobs)))


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_the_loop_trains_on_sft_data(runs, packing):
    results = runs[packing]
    for out in results:
        assert out["tensor_vs_batch"][0] == out["tensor_vs_batch"][1]
        assert math.isclose(*out["padded_vs_alone"], rel_tol=1e-5)
        assert len(out["losses"]) == STEPS and all(math.isfinite(x) for x in out["losses"])
        assert out["probe_after"] < out["probe_before"] - 0.5  # it learns the answers
    assert results[0]["losses"] != results[1]["losses"]  # each rank its own rows
