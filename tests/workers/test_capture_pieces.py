"""What a surviving rank captures (workers/capture.py), on real DeepSpeed engines (gloo, CPU)."""

import pytest

pytestmark = pytest.mark.slow


def _coverage(result):
    """Per parameter, the sorted element ranges one rank's capture covers, merged."""
    out = {}
    for name, pieces in result["covered"].items():
        merged = []
        for offset, length in sorted(pieces):
            if merged and merged[-1][1] == offset:
                merged[-1][1] = offset + length
            else:
                merged.append([offset, offset + length])
        out[name] = merged
    return out


@pytest.mark.parametrize("zero_stage", [0])  # ZeRO-3: tests/e2e/test_e2e_ray.py checks a real capture bit for bit
def test_a_survivor_captures_its_state_and_any_single_death_is_covered(tied_llama_jobs, zero_stage):
    results = tied_llama_jobs["capture"][zero_stage]  # spawned with the other tied-Llama jobs: tests/conftest.py
    assert all(r["step"] == 2 and r["equal"] for r in results)  # the state at the last step, exactly
    assert all(r["ahead"] == 3 for r in results)  # a state one update past the last report says so
    numel = {name.removeprefix("fp32/"): n for name, n in results[0]["numel"].items()}
    for survivor in results:
        covered = _coverage(survivor)
        if zero_stage == 0:  # every rank holds everything: it captures its own slice and its neighbours'
            assert covered == {name: [[0, n]] for name, n in numel.items()}  # with 2 ranks: all of it
    if zero_stage == 3:  # each rank its own partition: together, everything, once
        total = sum(length for r in results for pieces in r["covered"].values() for _, length in pieces)
        assert total == sum(numel.values())
