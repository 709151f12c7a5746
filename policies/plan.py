"""The recovery plan: which persisted version of each layer goes into the composite.

Pure: it takes the committed versions as values (the store reads them) and returns a plan.
For every layer it picks the newest usable version taken at or before ``t_fail``; the base
checkpoint is simply the oldest version of every layer, so it is the fallback by construction.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass


class NoUsableVersionError(RuntimeError):
    """Some layer has no committed, usable version at or before the recovery step."""


@dataclass(frozen=True, order=True)
class VersionRef:
    """One committed version of one layer, as the plan needs to see it."""

    step: int
    layer: str
    version_id: str
    base: bool = False
    partial: bool = False
    """Holds only some ranks' slices (a survivor's capture): never a layer's whole state alone."""


@dataclass(frozen=True)
class LayerChoice:
    layer: str
    version: VersionRef
    staleness: int


@dataclass(frozen=True)
class RecoveryPlan:
    """For each layer (model order) the version to load, and how stale the composite is."""

    t_fail: int
    choices: tuple[LayerChoice, ...]
    max_staleness: int
    weighted_staleness: float

    def version_of(self, layer: str) -> VersionRef:
        for choice in self.choices:
            if choice.layer == layer:
                return choice.version
        raise KeyError(layer)


def plan_recovery(
    layer_numel: Mapping[str, int],
    versions: Iterable[VersionRef],
    t_fail: int,
    skip: Collection[str] = (),
) -> RecoveryPlan:
    """Pick, for every layer of ``layer_numel`` (in its order), its newest whole (not partial)
    version at or before ``t_fail`` whose ``version_id`` is not in ``skip`` (versions found
    corrupt, say). Partial versions are overlaid on these choices elsewhere.

    Raises :class:`NoUsableVersionError` naming every layer left without a version and what
    was tried for it.
    """
    by_layer: dict[str, list[VersionRef]] = {name: [] for name in layer_numel}
    for version in versions:
        if version.layer in by_layer:
            by_layer[version.layer].append(version)
    choices: list[LayerChoice] = []
    missing: list[str] = []
    for layer, candidates in by_layer.items():
        usable = [v for v in candidates if not v.partial and v.step <= t_fail and v.version_id not in skip]
        if not usable:
            tried = sorted(v.version_id for v in candidates if not v.partial and v.step <= t_fail)
            missing.append(f"{layer} (tried: {', '.join(tried) or 'no version at or before the step'})")
            continue
        newest = max(usable, key=lambda v: (v.step, not v.base))
        choices.append(LayerChoice(layer=layer, version=newest, staleness=t_fail - newest.step))
    if missing:
        raise NoUsableVersionError(f"cannot recover at step {t_fail}: no usable version for " + "; ".join(missing))
    total = sum(layer_numel.values())
    weighted = sum(layer_numel[c.layer] * c.staleness for c in choices) / total if total else 0.0
    return RecoveryPlan(
        t_fail=t_fail,
        choices=tuple(choices),
        max_staleness=max((c.staleness for c in choices), default=0),
        weighted_staleness=weighted,
    )


def newest_recoverable_step(layer_names: Collection[str], versions: Iterable[VersionRef]) -> int | None:
    """The newest step at which every layer has some version (the default ``t_fail``): the
    step of the newest version, provided every layer has at least one version at all."""
    seen: dict[str, int] = {}
    for v in versions:
        if v.partial:
            continue  # only some ranks' slices: a layer needs a whole version to be recoverable
        seen[v.layer] = max(seen.get(v.layer, v.step), v.step)
    if not layer_names or any(name not in seen for name in layer_names):
        return None
    return max(seen[name] for name in layer_names)
