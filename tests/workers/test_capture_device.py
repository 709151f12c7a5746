"""A survivor's capture on a real one-rank DeepSpeed engine (ZeRO 1, 2, 3; bf16 with fp32 masters),
released from its collective by an abort asked from another thread as Ray Train's controller asks
(:mod:`layercheck.workers.collective_abort`): the capture, copied to host memory, equals the optimizer's
state at the last completed step bit for bit.

``cpu``: gloo; the real abort is not needed and leaves the group working, the block and its
release are scripted. ``cuda`` (``LAYERCHECK_TEST_DEVICE=cuda``, ``scripts/gpu_checks.sh``): NCCL;
torch's own abort of every group, a collective after it raises, the process survives (the NCCL
watchdog does not end it), the capture goes through the side-stream copier into pinned memory.
What one GPU cannot show: a real peer dying under an NCCL collective (NCCL takes one rank per GPU).
"""

from __future__ import annotations

import pytest

from tests.support.capture_jobs import released_capture_job
from tests.support.devices import cuda_requested, devices, require
from tests.support.dist_harness import run_jobs, run_ranks

pytestmark = pytest.mark.slow

CONFIGS = [(1, "bf16"), (2, "bf16"), (3, "bf16")]


@pytest.fixture(scope="module")
def on_cpu():
    """Every configuration's CPU (gloo) case, one after another in one spawned rank (gloo's abort
    leaves the group working). A CUDA case spawns its own: NCCL's abort ends every group."""
    return dict(zip(CONFIGS, (r for (r,) in run_jobs(1, [(released_capture_job, c) for c in CONFIGS]))))


@pytest.mark.parametrize("stage,precision", CONFIGS, ids=[f"zero{s}-{p}" for s, p in CONFIGS])
@pytest.mark.parametrize("device", devices())
def test_a_released_survivor_captures_its_state_bit_for_bit(request, device, stage, precision):
    require(device)
    if device == "cpu" and cuda_requested():
        pytest.skip("the CPU case runs where CUDA is not requested (a spawned rank here would take the GPU)")
    if device == "cpu":
        result = request.getfixturevalue("on_cpu")[stage, precision]
    else:
        (result,) = run_ranks(released_capture_job, 1, stage, precision)
    assert result["answers"] == ["abort"]  # asked while training and blocked: it aborted
    assert result["raised"], "the collective after the abort did not raise"
    assert result["answer_after"] == "already_aborted"  # once only
    assert result["captured_steps"] == [2]  # the last completed step: nothing stepped since
    assert result["compared"] > 0 and result["equal"]
    if device == "cuda":
        assert result["backend"] == "nccl"
        assert result["copier"] == "SideStreamCopier" and result["pinned"]
    else:
        assert result["backend"] == "gloo" and result["copier"] == "HostCopier"
        assert result["real_answer"] == "not_needed" and result["group_works"]  # harmless on gloo
