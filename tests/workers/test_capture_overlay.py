"""Recovery from a survivor's capture, with real DeepSpeed (ZeRO-3, 2 ranks, gloo on CPU): every
layer whole at step S, then rank 0's slices alone at step T (what a survivor hands over when its
peer dies). Recovering at t_fail = T gives rank 0's slices their step-T values and rank 1's their
step-S values, bit for bit, and the plan's account says which elements came from where."""

import pytest

from tests.support import overlay_jobs as jobs


@pytest.mark.slow
def test_rank_0s_capture_overlays_the_whole_versions_bit_for_bit(tied_llama_jobs):
    results = tied_llama_jobs["overlay"]  # spawned with the other tied-Llama jobs: tests/conftest.py
    saver = results[0]
    assert saver["mismatches"] == []
    assert saver["captured_moved"] > 0 and saver["rest_moved"] > 0, "both halves must differ between S and T"
    for r in results:
        assert all(step in (jobs.T, 0) for step in r["adam_steps"].values()), r["adam_steps"]
        assert r["max_staleness"] == jobs.T - jobs.S
    captured = sum(s["elements"] for layer in saver["sources"].values() for s in layer if s["origin"] == "capture")
    stored = sum(s["elements"] for layer in saver["sources"].values() for s in layer if s["origin"] == "policy")
    assert captured == saver["captured_elements"] > 0 and stored == saver["rest_elements"] > 0
    for layer, sources in saver["sources"].items():
        assert [(s["origin"], s["step"], s["ranks"]) for s in sources] == [
            ("capture", jobs.T, [0]),
            ("policy", jobs.S, [0, 1]),
        ], layer
