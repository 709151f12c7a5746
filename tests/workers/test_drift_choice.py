"""Which steps DriftAdamW runs on each kind of device (``layercheck.workers.drift.choice``): asked of
the chooser for ``cuda`` as for ``cpu``, so the CUDA choice is tested without a GPU; what the
optimizer then runs is ``tests/workers/test_drift_fused.py``'s (on CUDA with ``LAYERCHECK_TEST_DEVICE``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layercheck.workers.drift import choice
from layercheck.workers.drift.adamw import DriftAdamW
from layercheck.workers.drift.choice import SAMPLED_COSTS, Figure, StepChoice, choose_steps

ROOT = Path(__file__).resolve().parents[2]


def _no_triton() -> bool:
    raise AssertionError("Triton's eligibility asked where no committed figure could pick its step")


def test_auto_on_cuda_is_the_sampled_snapshot_and_diff_around_torchs_fused_adamw():
    picked = choose_steps("auto", "cuda", triton=_no_triton)
    assert (picked.measured, picked.torch_step, picked.counts_on_device) == ("foreach", "fused", True)
    assert "1.07x" in picked.reason and "gpu-2026-12-04-NVIDIA-H200" in picked.reason


def test_auto_on_cpu_stays_as_measured_there():
    picked = choose_steps("auto", "cpu")
    assert (picked.measured, picked.torch_step, picked.counts_on_device) == ("foreach", "fused", True)
    assert "cpu-drift-sampling" in picked.reason


@pytest.mark.parametrize(
    "drift_step,device,measured,torch_step",
    [
        ("foreach", "cuda", "foreach", "fused"),
        ("fused", "cuda", "fused", "foreach"),  # the Triton step reads its counts on the host
        ("fused", "cpu", "fused", "fused"),
        ("auto", "xpu", "foreach", "foreach"),  # no figure, no fused kernel LayerCheck runs there
    ],
)
def test_a_named_step_is_kept_and_torchs_kernel_follows_where_the_counts_live(drift_step, device, measured, torch_step):
    picked = choose_steps(drift_step, device, triton=_no_triton)
    assert (picked.measured, picked.torch_step) == (measured, torch_step)
    assert picked.counts_on_device == (torch_step == "fused")


def test_auto_follows_the_figures_when_one_is_committed(monkeypatch):
    cheaper = Figure(1.01, "a committed sampled timing of the Triton step")
    monkeypatch.setitem(choice.SAMPLED_COSTS, "cuda", {**SAMPLED_COSTS["cuda"], "fused": cheaper})
    assert choose_steps("auto", "cuda", triton=lambda: True).measured == "fused"
    assert choose_steps("auto", "cuda", triton=lambda: False).measured == "foreach"  # its kernel cannot run


def test_every_figure_names_a_committed_result():
    for figures in SAMPLED_COSTS.values():
        for figure in figures.values():
            assert figure.x_fused_adamw > 0
            assert (ROOT / figure.source.split(",")[0]).is_dir(), figure.source


def test_a_bad_drift_step_is_refused():
    with pytest.raises(ValueError, match="drift_step"):
        choose_steps("triton", "cuda")


def test_the_optimizer_carries_out_the_choice_for_its_parameters_device():
    params = [torch.randn(4, 3, requires_grad=True), torch.randn(5, requires_grad=True)]
    optimizer = DriftAdamW([{"params": params, "name": "g"}], lr=1e-3)
    assert optimizer.steps == choose_steps("auto", "cpu") and optimizer.measured_step == "foreach"
    optimizer.drift_step = "fused"  # (what drift_probe="fused" does): chosen again
    assert optimizer.steps == StepChoice(measured="fused", torch_step="fused", reason="drift_step='fused'")
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert set(optimizer.take_drift()) == {"g"}
    assert all(optimizer.state[p]["step"].device.type == "cpu" for p in params)
