"""ETTR at cluster scale from measured costs: Monte-Carlo over exponential failures, and the
Young/Daly closed form for the rollback baselines.

ETTR (effective training time ratio) = productive time / wall-clock time, where productive
time is the failure-free, checkpoint-free time of the same steps (``base_step_s`` each).

A strategy is described by :class:`Costs` (what ``layercheck bench`` measured): its step time
with checkpointing, how a failure is recovered, its interval, checkpoint stall, bytes, and the
time of one recovery (plan + load + delta replay; the re-run steps of a rollback are simulated,
not taken from the measurement). ``restart_s`` is the time to bring a failed worker group
back, the same for every strategy: by default the bench's worker imports and engine build, or
measured end to end by ``bench/recovery_paths.py`` on real Ray Train runs, per recovery path (a
full restart, in place: :func:`restart_by_path`). Failures arrive as a
Poisson process of rate ``1 / MTBF`` while the job trains; a recovery is not interrupted
(the usual simplification; it matters only when recovery time approaches the MTBF).

Cluster MTBF for ``n`` GPUs is the per-GPU MTBF divided by ``n`` (independent failures). With a
scale harness's report (``layercheck ettr --scale``, :mod:`layercheck.bench.scale.costs`), each GPU
count's point also charges LayerCheck's strategies the control plane measured at that count: the
recovery plan, and the control actors' CPU beyond the step (:meth:`Costs.at_control_plane`).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from layercheck.bench.scale.costs import ControlPlaneCost, ScaleCosts

ROLLBACK = "rollback"
RESTART = "restart"
RESUME = "resume"
REPLAY_DELTAS = "replay-deltas"
RECOVERIES = (ROLLBACK, RESTART, RESUME, REPLAY_DELTAS)
#: ``bench/recovery_paths.py``'s name of the path on which the survivors keep their processes.
IN_PLACE = "in place"
IN_PLACE_SPARE = "in place + spare"

HOUR = 3600.0
MTBF_HOURS: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0, 12.0, 24.0)
GPU_COUNTS: tuple[int, ...] = tuple(2**k for k in range(3, 15))  # 8 .. 16384
#: Per-GPU MTBF default: a 16,384-GPU job interrupted every ~3 h (the order reported for large
#: LLM pre-training runs, e.g. Llama 3's 419 interruptions in 54 days) gives ~50,000 GPU-hours.
PER_GPU_MTBF_HOURS = 50_000.0


@dataclass(frozen=True, kw_only=True)
class Costs:
    name: str
    recovery: str
    base_step_s: float
    """Failure-free step time without checkpointing (the ``none`` run)."""
    step_s: float
    """This strategy's failure-free step time, its checkpoint stalls and probe included."""
    interval: int = 0
    """Steps between full checkpoints (rollback: what a failure rolls back to)."""
    stall_per_event_s: float = 0.0
    bytes_per_step: float = 0.0
    bytes_per_event: float = 0.0
    recovery_s: float = 0.0
    """Plan + load (+ delta replay) of one recovery."""
    restart_s: float = 0.0
    sync_write: bool = False
    """The checkpoint is written on the training thread (its stall scales with storage bandwidth)."""

    def __post_init__(self) -> None:
        if self.recovery not in RECOVERIES:
            raise ValueError(f"Costs.recovery: one of {RECOVERIES}, got {self.recovery!r}")
        if self.base_step_s <= 0 or self.step_s <= 0:
            raise ValueError(f"Costs {self.name}: step times must be > 0")
        if self.recovery == ROLLBACK and self.interval < 1:
            raise ValueError(f"Costs {self.name}: a rollback strategy needs interval >= 1")

    def with_storage(self, bytes_per_s: float | None) -> Costs:
        """The costs on storage of ``bytes_per_s``: a synchronous checkpoint stalls for its
        bytes' write time; background writes slow training only when they cannot keep up."""
        if not bytes_per_s:
            return self
        if self.sync_write:
            per_step = self.step_s - (self.stall_per_event_s / self.interval if self.interval else 0.0)
            stall = self.bytes_per_event / bytes_per_s
            step = per_step + (stall / self.interval if self.interval else 0.0)
            return replace(self, step_s=step, stall_per_event_s=stall)
        backlog = max(0.0, self.bytes_per_step / bytes_per_s - self.step_s)
        return replace(self, step_s=self.step_s + backlog)

    def at_control_plane(self, cost: ControlPlaneCost) -> Costs:
        """The costs at ``cost``'s GPU count (``layercheck ettr --scale``): a strategy that resumes
        at ``t_fail + 1`` runs on LayerCheck's control plane, so its recovery also plans over every
        rank's versions, and its steps wait for the control actors' CPU beyond the step. A rollback
        baseline's checkpoints never meet LayerCheck's actors: unchanged."""
        if self.recovery not in (RESUME, REPLAY_DELTAS):
            return self
        return replace(self, recovery_s=self.recovery_s + cost.plan_s, step_s=self.step_s + cost.unfit_s(self.step_s))


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval ``sqrt(2 δ M)`` (seconds of work between checkpoints)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_ettr(*, interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float) -> float:
    """Daly's expected ETTR for rollback with exponential failures: work ``τ`` between
    checkpoints costing ``δ``, restart ``R``: ``τ / (M e^{R/M} (e^{(τ+δ)/M} − 1))``."""
    tau, delta, r, m = interval_s, checkpoint_s, restart_s, mtbf_s
    if tau <= 0:
        return 0.0
    return tau / (m * math.exp(r / m) * math.expm1((tau + delta) / m))


def resume_ettr(costs: Costs, mtbf_s: float) -> float:
    """Closed form for strategies that lose no steps: slower steps, plus ``R + recovery`` per failure."""
    return costs.base_step_s / (costs.step_s * (1.0 + (costs.restart_s + costs.recovery_s) / mtbf_s))


def restart_ettr(costs: Costs, mtbf_s: float, work_steps: int) -> float:
    """No checkpoints: a job of ``W`` seconds needs a failure-free stretch of ``W``; expected
    wall time ``M e^{R/M} (e^{W/M} - 1)`` (Daly with one interval spanning the job)."""
    work = work_steps * costs.step_s
    exponent = work / mtbf_s
    if exponent > 700:
        return 0.0
    return work_steps * costs.base_step_s / (mtbf_s * math.exp(costs.restart_s / mtbf_s) * math.expm1(exponent))


def closed_form(costs: Costs, mtbf_s: float) -> dict[str, float]:
    """ETTR by formula: Daly at the measured interval and at Young's optimum (rollback), or
    :func:`resume_ettr`. Rollback ETTR is scaled by ``base_step_s / work step time``."""
    if costs.recovery in (RESUME, REPLAY_DELTAS):
        return {"ettr": resume_ettr(costs, mtbf_s)}
    if costs.recovery == RESTART:
        return {}  # no checkpoint: the answer depends on the job length; see simulate()
    work_step = max(costs.base_step_s, costs.step_s - costs.stall_per_event_s / costs.interval)
    scale = costs.base_step_s / work_step
    r = costs.restart_s + costs.recovery_s
    tau = costs.interval * work_step
    delta = costs.stall_per_event_s
    best_tau = max(young_interval_s(delta, mtbf_s), work_step)
    return {
        "ettr": scale * daly_ettr(interval_s=tau, checkpoint_s=delta, restart_s=r, mtbf_s=mtbf_s),
        "ettr_young": scale * daly_ettr(interval_s=best_tau, checkpoint_s=delta, restart_s=r, mtbf_s=mtbf_s),
        "young_interval_steps": best_tau / work_step,
    }


def simulate_once(costs: Costs, mtbf_s: float, work_steps: int, rng: random.Random) -> float:
    """One run of ``work_steps`` steps under exponential failures; its ETTR."""
    c = costs.step_s
    progress, elapsed = 0, 0.0
    per_failure = costs.restart_s + costs.recovery_s
    while True:
        until_failure = rng.expovariate(1.0 / mtbf_s)
        remaining = (work_steps - progress) * c
        if until_failure >= remaining:
            elapsed += remaining
            break
        done = int(until_failure // c)
        if costs.recovery == ROLLBACK:
            progress = ((progress + done) // costs.interval) * costs.interval
        elif costs.recovery == RESTART:
            progress = 0
        else:
            progress += done
        elapsed += until_failure + per_failure
    return work_steps * costs.base_step_s / elapsed


def simulate(
    costs: Costs, mtbf_s: float, *, runs: int = 200, work_s: float | None = None, seed: int = 0
) -> dict[str, float]:
    """Mean, standard deviation and 5th/95th percentiles of ETTR over ``runs`` runs of
    ``work_s`` productive seconds (default: 10 MTBFs, at least one hour)."""
    work_s = work_s if work_s is not None else max(HOUR, 10.0 * mtbf_s)
    steps = max(1, int(work_s / costs.base_step_s))
    if costs.recovery == RESTART:  # expected value in closed form: simulating it can take ~e^(W/M) failures
        value = restart_ettr(costs, mtbf_s, steps)
        return {"mean": value, "std": 0.0, "p05": value, "p95": value}
    rng = random.Random(seed)
    values = sorted(simulate_once(costs, mtbf_s, steps, rng) for _ in range(runs))
    return {
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values),
        "p05": values[int(0.05 * (len(values) - 1))],
        "p95": values[int(0.95 * (len(values) - 1))],
    }


def grid(
    costs: Sequence[Costs],
    *,
    mtbf_hours: Sequence[float] = MTBF_HOURS,
    gpu_counts: Sequence[int] = GPU_COUNTS,
    per_gpu_mtbf_hours: float = PER_GPU_MTBF_HOURS,
    runs: int = 200,
    seed: int = 0,
    storage_bytes_per_s: float | None = None,
    scale: ScaleCosts | None = None,
) -> dict[str, Any]:
    """ETTR of every strategy for each cluster MTBF and for each GPU count. With ``scale`` (a
    ``scale.json``'s per-N costs), each GPU count's point charges LayerCheck's strategies the control
    plane's cost at that count (:meth:`Costs.at_control_plane`), and ``scale`` says what was taken;
    the cluster-MTBF points name no GPU count and stay as measured."""
    scaled = [c.with_storage(storage_bytes_per_s) for c in costs]

    def point(c: Costs, mtbf_h: float) -> dict[str, Any]:
        m = mtbf_h * HOUR
        return {"mtbf_hours": mtbf_h, "sim": simulate(c, m, runs=runs, seed=seed), "closed": closed_form(c, m)}

    def at_gpus(c: Costs, n: int) -> Costs:
        return c.at_control_plane(scale.at(n)) if scale is not None else c

    out: dict[str, Any] = {
        "per_gpu_mtbf_hours": per_gpu_mtbf_hours,
        "storage_bytes_per_s": storage_bytes_per_s,
        "runs": runs,
        "costs": [asdict(c) for c in scaled],
        "by_mtbf": {c.name: [point(c, h) for h in mtbf_hours] for c in scaled},
        "by_gpus": {
            c.name: [{"gpus": n, **point(at_gpus(c, n), per_gpu_mtbf_hours / n)} for n in gpu_counts] for c in scaled
        },
    }
    if scale is not None:
        out["scale"] = {"by_gpus": [scale.at(n).to_json() for n in gpu_counts], "history_s": scale.history_s}
    return out


def restart_by_path(recovery_paths: Mapping[str, Any]) -> dict[str, float]:
    """Per recovery path of a ``bench/recovery_paths.py`` report (``full restart``, ``in place``):
    what a failure costs beside the strategy's own plan and load, measured on real runs — the
    median time from the failure to the next completed step, less its plan, load and first step
    (the model adds the strategy's own plan and load; the first step is a step like any)."""
    out = {}
    for path, runs in recovery_paths["runs"].items():
        if not runs:
            raise ValueError(f"recovery path {path!r} has no runs")
        out[path] = statistics.median(
            max(0.0, r["failure_to_step_s"] - sum(r["timeline"][k] for k in ("plan", "load", "first_step")))
            for r in runs
        )
    return out


def costs_from_bench(
    report: Mapping[str, Any], *, restart_s: float | None = None, by_path: Mapping[str, float] | None = None
) -> list[Costs]:
    """:class:`Costs` for each strategy row of a ``layercheck bench --json`` report; with
    ``by_path`` (:func:`restart_by_path`), each strategy once per recovery path, named
    ``<strategy> · <path>``, with that path's measured restart. In place is LayerCheck's: only
    strategies that resume at ``t_fail + 1`` get it (a rollback reloads a full checkpoint on every rank)."""
    if by_path:
        return [
            replace(c, name=f"{c.name} · {path}", restart_s=seconds)
            for path, seconds in by_path.items()
            for c in costs_from_bench(report)
            if path not in (IN_PLACE, IN_PLACE_SPARE) or c.recovery in (RESUME, REPLAY_DELTAS)
        ]
    rows = report["strategies"]
    base = rows["none"]["model_step_s"]
    restart = report["restart_s"] if restart_s is None else restart_s
    out = []
    for name, row in rows.items():
        out.append(
            Costs(
                name=name,
                recovery=row["recovery"],
                base_step_s=base,
                step_s=max(row["model_step_s"], base),
                interval=row["interval"] or 0,
                stall_per_event_s=row["stall_per_event_s"],
                bytes_per_step=row["bytes_per_step"],
                bytes_per_event=row["bytes_per_event"],
                recovery_s=row["recovery_s"],
                restart_s=restart,
                sync_write=row["kind"] in ("deepspeed-sync", "dcp-sync"),
            )
        )
    return out
