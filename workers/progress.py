"""What rank 0 reports to the run's central view (the supervisor) after each step. Importing this
module does not import torch: the driver's side reads it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProbeCost:
    """What measuring drift cost one rank over one step (:mod:`layercheck.workers.drift.clock`)."""

    probe: str
    """Which probe ran: ``snapshot_diff``, ``optimizer (foreach)`` or ``optimizer (fused)``."""
    seconds: float
    """Its own work finished since the previous report (a GPU's spans count once read)."""
    measured: bool
    """Whether the step's drift was measured (the policy's ``drift_every``)."""
    replaced: bool = False
    """Whether the step's timed work was a whole update run in place of the optimizer's own step
    (``optimizer (fused)``, ``fused (in place of your AdamW)``; not on a step measured by copying)."""
    own_step_s: float = 0.0
    """Such a probe also times the optimizer's own step, on the unmeasured step after each replaced
    one: what a replaced step stands in for. Its time finished since the previous report, and
    (``own_steps``) the steps so timed (0 or 1)."""
    own_steps: int = 0


@dataclass(frozen=True)
class StepProgress:
    """Rank 0's report of one step."""

    step: int
    loss: float
    lr: float
    compute_s: float
    """The step's forward, backward and optimizer step."""
    stall_s: float
    """Training time spent handing snapshots over."""
    coordination_s: float = 0.0
    """Time in the policy protocol (drift report and decision)."""
    probe: ProbeCost | None = None
    """What measuring the step's drift cost (``None``: not timed)."""
    handed_over: tuple[str, ...] = ()
    """The layers whose state after this step the rank handed to its writer (the step's decision
    carried out; every rank hands over the same): versions storage now owes the run."""
    memory_s: float = 0.0
    """Of the step's stall, the memory versions' copy and hand-over (``persistence.memory_period``;
    on a GPU a copy's hand-over comes at a later step's): what ``"auto"`` times to choose the period."""
