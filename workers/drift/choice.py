"""Which steps :class:`~layercheck.workers.drift.adamw.DriftAdamW` runs on a kind of device: its
measured step (``drift_step``) and torch's AdamW kernel on every other step, a value
(:class:`StepChoice`) decided here and carried out by the optimizer.

``drift_step="auto"`` takes, for the kind of device the parameters live on, the measured step
whose committed cost per step under the default schedule (drift measured at every 10th step) is
the lowest: :data:`SAMPLED_COSTS`, each figure naming the benchmark result it comes from. A step
with no committed figure on a device is not picked there until a benchmark commits one.

torch's own AdamW step (every unmeasured step, and the update inside a ``foreach`` measured step,
which copies the owned elements before it and diffs them after) is torch's fused kernel where
torch has one (CPU, CUDA), with the step counts where that kernel reads them: on the parameters'
device. Beside the Triton drift step on CUDA (``fused``), which reads the counts on the host to
build its scalars, the counts stay on the host and torch's step is its foreach one, which takes
host counts (a device count would cost a host sync per measured step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from layercheck.workers.config import DRIFT_STEPS

logger = logging.getLogger(__name__)

#: Kinds of device where torch's AdamW has a fused kernel that LayerCheck runs.
TORCH_FUSED_DEVICES: tuple[str, ...] = ("cpu", "cuda")


@dataclass(frozen=True)
class Figure:
    """A measured step's committed cost under the default schedule, per optimizer step."""

    x_fused_adamw: float
    """Seconds per step (the measured one and the nine that are not, averaged) over torch's fused
    AdamW step's, on the same machine and model."""
    source: str
    """The committed benchmark result it comes from."""


#: Per kind of device, each measured step's committed cost under the default schedule: what
#: ``drift_step="auto"`` picks by. The Triton step (``fused``) has none yet on CUDA: it was timed
#: at every step only (2.02x torch's fused AdamW on the 2026-12-04 H200), never sampled.
SAMPLED_COSTS: Mapping[str, Mapping[str, Figure]] = {
    "cuda": {
        "foreach": Figure(
            1.07,
            "bench/results/gpu-2026-12-04-NVIDIA-H200, snapshot_diff@10: torch's fused AdamW, the owned "
            "elements diffed against a copy at every 10th step (5.05 ms against 4.74 ms)",
        ),
    },
    "cpu": {
        "foreach": Figure(
            0.93,
            "bench/results/cpu-drift-sampling, drift_adamw@10: torch's fused AdamW, the owned elements "
            "copied and diffed at every 10th step (2.09 ms against 2.25 ms)",
        ),
    },
}


@dataclass(frozen=True)
class StepChoice:
    """The steps DriftAdamW runs on one kind of device, and why."""

    measured: str
    """A measured step: ``foreach`` (torch's step, the owned elements copied before and diffed
    after) or ``fused`` (the drift counted inside the update)."""
    torch_step: str
    """torch's AdamW kernel, on unmeasured steps and inside a ``foreach`` measured one:
    ``fused`` or ``foreach``."""
    reason: str

    @property
    def counts_on_device(self) -> bool:
        """Whether the step counts live on the parameters' device (torch's fused kernel reads them
        there); else on the host."""
        return self.torch_step == "fused"


def choose_steps(drift_step: str, device_type: str, *, triton: Callable[[], bool] = lambda: True) -> StepChoice:
    """The steps for parameters on a ``device_type`` device (``"cuda"``, ``"cpu"``, ...) under
    ``drift_step`` (:data:`~layercheck.workers.config.DRIFT_STEPS`). ``triton``: whether the Triton
    kernel takes the parameters, asked only where a committed figure could pick it (CUDA)."""
    if drift_step not in DRIFT_STEPS:
        raise ValueError(f"drift_step: must be one of {DRIFT_STEPS}, got {drift_step!r}")
    if drift_step == "auto":
        measured, why = _cheapest(device_type, triton)
    else:
        measured, why = drift_step, f"drift_step={drift_step!r}"
    host_counts = measured == "fused" and device_type != "cpu"  # the Triton step reads them on the host
    torch_step = "fused" if device_type in TORCH_FUSED_DEVICES and not host_counts else "foreach"
    return StepChoice(measured=measured, torch_step=torch_step, reason=why)


def _cheapest(device_type: str, triton: Callable[[], bool]) -> tuple[str, str]:
    figures = SAMPLED_COSTS.get(device_type, {})
    usable = {step: f for step, f in figures.items() if step != "fused" or device_type != "cuda" or triton()}
    if not usable:
        return "foreach", f"auto: no committed figure on {device_type}; torch's own step, copied and diffed"
    step, figure = min(usable.items(), key=lambda item: item[1].x_fused_adamw)
    return (
        step,
        f"auto: the cheapest committed on {device_type}, {figure.x_fused_adamw:.2f}x torch's fused AdamW a step ({figure.source})",
    )
