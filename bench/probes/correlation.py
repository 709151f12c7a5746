"""Freshness measures of a recovery point and how well each predicts the damage (pure).

At a failure after step ``t`` a composite holds, per layer ℓ, the state taken at ``t_ℓ <= t``.
Four measures of how much it lost, each parameter-weighted over the layers:

* ``weighted_staleness``: ``sum n_ℓ (t - t_ℓ) / N`` (steps);
* ``unsaved_drift``: ``sum n_ℓ D_ℓ / N`` with ``D_ℓ`` the layer's per-step drift (mean absolute
  update) summed over ``(t_ℓ, t]``, what the policies accumulate;
* ``unsaved_drift_relative``: ``sum n_ℓ D_ℓ / a_ℓ / N`` with ``a_ℓ`` the layer's mean ``|θ|`` at
  ``t``: the drift relative to the layer's size;
* ``lost_distance``: ``sum n_ℓ mean|θ_ℓ(t) - θ_ℓ(t_ℓ)| / N``, the exact distance between the
  state lost and the state recovered (the drift sum over-counts updates that cancel).

:func:`correlations` gives each measure's Pearson and Spearman correlation with the loss
deviation after recovery.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

MEASURES: tuple[str, ...] = ("weighted_staleness", "unsaved_drift", "unsaved_drift_relative", "lost_distance")


def weighted_staleness(numel: Mapping[str, int], versions: Mapping[str, int], t: int) -> float:
    total = sum(numel.values())
    return sum(n * (t - versions.get(name, 0)) for name, n in numel.items()) / total


def unsaved_drift(
    numel: Mapping[str, int],
    versions: Mapping[str, int],
    t: int,
    drift: Mapping[int, Mapping[str, float]],
    scale: Mapping[str, float] | None = None,
) -> float:
    """``sum n_ℓ D_ℓ / N`` (``scale``: divide each ``D_ℓ`` by ``scale[ℓ]`` first)."""
    total = sum(numel.values())
    out = 0.0
    for name, n in numel.items():
        lost = sum(drift.get(s, {}).get(name, 0.0) for s in range(versions.get(name, 0) + 1, t + 1))
        out += n * lost / (scale[name] if scale else 1.0)
    return out / total


def weighted_mean(numel: Mapping[str, int], per_layer: Mapping[str, float]) -> float:
    return sum(n * per_layer[name] for name, n in numel.items()) / sum(numel.values())


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson's r; NaN when either series is constant or shorter than 3."""
    if len(x) != len(y):
        raise ValueError(f"pearson: series of different lengths ({len(x)}, {len(y)})")
    if len(x) < 3:
        return math.nan
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    return pearson(ranks(x), ranks(y))


def correlations(points: Sequence[Mapping[str, float]], target: str = "loss_dev_mean") -> dict[str, dict[str, float]]:
    """Per measure of :data:`MEASURES`: Pearson and Spearman with ``target`` over ``points``."""
    y = [float(p[target]) for p in points]
    out = {}
    for measure in MEASURES:
        x = [float(p[measure]) for p in points]
        out[measure] = {"pearson": pearson(x, y), "spearman": spearman(x, y), "n": len(points)}
    return out
