"""The built-in loop trains on SFT data on real DeepSpeed (ZeRO-3, gloo, 2 ranks)."""

import math
from pathlib import Path

import pytest

from tests.support import sft_jobs
from tests.support.dist_harness import run_ranks

DATA = Path(__file__).resolve().parent.parent / "examples" / "data"


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_the_loop_trains_on_sft_data(packing):
    steps = 8
    results = run_ranks(sft_jobs.sft_loop_job, 2, str(DATA / "sft.jsonl"), str(DATA / "sft-tokenizer"), packing, steps)
    for out in results:
        assert out["tensor_vs_batch"][0] == out["tensor_vs_batch"][1]
        assert math.isclose(*out["padded_vs_alone"], rel_tol=1e-5)
        assert len(out["losses"]) == steps and all(math.isfinite(x) for x in out["losses"])
        assert out["probe_after"] < out["probe_before"] - 0.5  # it learns the answers
    assert results[0]["losses"] != results[1]["losses"]  # each rank its own rows
