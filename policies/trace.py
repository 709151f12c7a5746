"""Drift traces: per step, the learning rate and every layer's drift, plus the layer sizes.

A training run records one (``TraceRecorder`` in the orchestrator writes it); the simulator
replays it through any policy. Two text forms, parsed and written here without touching files:

* JSON: ``{"layers": [{"name": "embed", "numel": 32768}, ...],
  "steps": [{"step": 1, "lr": 1e-5, "drift": {"embed": 3.1e-6, ...}}, ...]}``
* CSV: a header ``step,lr,<layer>,<layer>,...``; one row per step; and one row whose ``step``
  cell is ``numel`` giving each layer's parameter count (its ``lr`` cell empty).

A run whose policy measures drift only every ``drift_every`` steps records the other steps with
their learning rate and no drift (JSON ``"drift": null``, CSV empty cells): missing, not zero.
:meth:`DriftTrace.filled` estimates them (each from the measurement that follows it) for replays.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from layercheck.policies.decision import StepObservation
from layercheck.policies.layer_map import EMBED, LM_HEAD, NORM, block_name


class TraceFormatError(ValueError):
    """A drift trace that cannot be parsed; the message says where."""


@dataclass(frozen=True)
class DriftTrace:
    layers: tuple[str, ...]
    numel: Mapping[str, int]
    steps: tuple[StepObservation, ...]

    def __post_init__(self) -> None:
        if set(self.numel) != set(self.layers):
            raise TraceFormatError(f"layer sizes {sorted(self.numel)} do not match layers {list(self.layers)}")
        previous = None
        for obs in self.steps:
            if previous is not None and obs.step <= previous:
                raise TraceFormatError(f"steps must increase: {obs.step} after {previous}")
            previous = obs.step
            if set(obs.drift) - set(self.layers):
                raise TraceFormatError(
                    f"step {obs.step}: drift for unknown layers {sorted(set(obs.drift) - set(self.layers))}"
                )

    @property
    def sampled(self) -> bool:
        """Some steps were not measured (the run's policy measured drift every few steps)."""
        return any(not o.measured for o in self.steps)

    def filled(self) -> DriftTrace:
        """This trace with every unmeasured step's drift estimated (:func:`filled`)."""
        return self if not self.sampled else DriftTrace(self.layers, self.numel, tuple(filled(self.steps)))

    def to_json(self) -> dict[str, object]:
        return {
            "layers": [{"name": name, "numel": self.numel[name]} for name in self.layers],
            "steps": [observation_json(o) for o in self.steps],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DriftTrace:  # Any: parsed JSON, checked here
        try:
            layers = [(str(entry["name"]), int(entry["numel"])) for entry in data["layers"]]
            steps = tuple(
                StepObservation(
                    step=int(entry["step"]),
                    lr=float(entry["lr"]),
                    drift={} if entry["drift"] is None else {str(k): float(v) for k, v in entry["drift"].items()},
                    measured=entry["drift"] is not None,
                )
                for entry in data["steps"]
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise TraceFormatError(f"not a drift trace: {exc!r}") from None
        return cls(layers=tuple(n for n, _ in layers), numel=dict(layers), steps=steps)

    def to_csv(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["step", "lr", *self.layers])
        writer.writerow(["numel", "", *(self.numel[n] for n in self.layers)])
        for obs in self.steps:
            cells = (repr(float(obs.drift.get(n, 0.0))) if obs.measured else "" for n in self.layers)
            writer.writerow([obs.step, repr(obs.lr), *cells])
        return out.getvalue()

    @classmethod
    def from_csv(cls, text: str) -> DriftTrace:
        rows = list(csv.reader(io.StringIO(text)))
        if not rows or rows[0][:2] != ["step", "lr"] or len(rows[0]) < 3:
            raise TraceFormatError("CSV trace must start with the header step,lr,<layer>,...")
        layers = tuple(rows[0][2:])
        numel: dict[str, int] | None = None
        steps = []
        for line, row in enumerate(rows[1:], start=2):
            if not row:
                continue
            if len(row) != len(rows[0]):
                raise TraceFormatError(f"line {line}: {len(row)} cells, header has {len(rows[0])}")
            try:
                if row[0] == "numel":
                    numel = {name: int(cell) for name, cell in zip(layers, row[2:])}
                elif not any(row[2:]):  # a step the run did not measure
                    steps.append(StepObservation(step=int(row[0]), lr=float(row[1]), measured=False))
                else:
                    drift = {name: float(cell) for name, cell in zip(layers, row[2:])}
                    steps.append(StepObservation(step=int(row[0]), lr=float(row[1]), drift=drift))
            except ValueError as exc:
                raise TraceFormatError(f"line {line}: {exc}") from None
        if numel is None:
            raise TraceFormatError("CSV trace has no 'numel' row giving the layer sizes")
        return cls(layers=layers, numel=numel, steps=tuple(steps))

    @classmethod
    def parse(cls, text: str) -> DriftTrace:
        """JSON or CSV, told apart by the first character."""
        if text.lstrip().startswith("{"):
            try:
                return cls.from_json(json.loads(text))
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"invalid JSON: {exc}") from None
        return cls.from_csv(text)


def observation_json(obs: StepObservation) -> dict[str, object]:
    """One step of a trace in its JSON form (``drift`` null where it was not measured)."""
    return {"step": obs.step, "lr": obs.lr, "drift": dict(obs.drift) if obs.measured else None}


def filled(steps: Sequence[StepObservation]) -> list[StepObservation]:
    """``steps`` with each unmeasured step's drift estimated by the next measured step's (a
    measurement stands for the steps since the one before it; after the last, the last), still
    marked unmeasured: what a replay uses for unsaved drift, while a policy that samples drift
    sees the steps as the run's policy did. Unchanged where every step was measured."""
    out = list(steps)
    estimate: Mapping[str, float] | None = None
    for i in range(len(out) - 1, -1, -1):
        if out[i].measured:
            estimate = out[i].drift
        elif estimate is not None:
            out[i] = replace(out[i], drift=dict(estimate))
    last = next((o.drift for o in reversed(out) if o.measured), None)
    for i in range(len(out) - 1, -1, -1):  # after the last measurement
        if out[i].measured or last is None:
            break
        out[i] = replace(out[i], drift=dict(last))
    return out


def lr_schedule(step: int, *, peak: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up to ``peak`` then cosine decay to ``min_ratio * peak`` at ``total``."""
    if warmup and step <= warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def synthetic_trace(
    *,
    blocks: int = 24,
    steps: int = 2000,
    peak_lr: float = 1e-5,
    warmup: int = 100,
    block_numel: int = 7_000_000,
    embed_numel: int = 50_000_000,
    spread: float = 0.3,
    seed: int = 0,
) -> DriftTrace:
    """A drift trace shaped like the ones measured on real fine-tuning (docs/schedules.md): per-step
    block drift ≈ 0.2 × lr, embedding ≈ 0.4 × lr in sparse bursts, final norm ≈ 0.1 × lr.
    ``spread`` sets how much blocks differ from each other (0: identical pace; the measured
    runs were close to 0, the paper's Figure 2 suggests more)."""
    rng = random.Random(seed)
    layers = (EMBED, *(block_name(i) for i in range(blocks)), NORM, LM_HEAD)
    numel = {EMBED: embed_numel, NORM: block_numel // 2000 or 1, LM_HEAD: embed_numel}
    rate = {EMBED: 0.4, NORM: 0.1, LM_HEAD: 0.25}
    for i in range(blocks):
        numel[block_name(i)] = block_numel
        rate[block_name(i)] = 0.2 * math.exp(spread * rng.gauss(0.0, 1.0))
    observations = []
    for step in range(1, steps + 1):
        lr = lr_schedule(step, peak=peak_lr, warmup=warmup, total=steps)
        drift = {name: rate[name] * lr * rng.lognormvariate(0.0, 0.25) for name in layers}
        if rng.random() < 0.5:  # embedding rows are touched only by the tokens in the batch
            drift[EMBED] *= 0.2
        observations.append(StepObservation(step=step, lr=lr, drift=drift))
    return DriftTrace(layers=layers, numel=numel, steps=tuple(observations))
