"""The recovery plan: which persisted version of each layer goes into the composite.

Pure: it takes the committed versions as values (the store reads them) and returns a plan.
For every layer it picks the newest usable whole version taken at or before ``t_fail``; the base
checkpoint is simply the oldest version of every layer, so it is the fallback by construction.
On that choice it overlays the layer's newer partial versions (a survivor's capture holds only
its own rank's slices), newest first: each element comes from the freshest source that holds
it (:func:`with_sources` counts them once the store has read which elements each one holds).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace

from layercheck.policies.layer_map import describe_layers
from layercheck.policies.overlay import Coverage, LayerSource, claim, claimed_elements, element_staleness

#: The origin of a layer's rebuilt step-0 state: a version every layer has when the run can
#: rebuild its initial state (no files; ``layercheck.orchestrator.store.initial_state``).
INITIAL_ORIGIN = "initial"


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
    origin: str = "policy"
    """``policy`` (a scheduled snapshot), ``capture`` (a survivor's hand-over) or ``initial``
    (:data:`INITIAL_ORIGIN`: the run's rebuilt step-0 state)."""


@dataclass(frozen=True)
class LayerChoice:
    layer: str
    version: VersionRef
    """The whole version the layer's state starts from."""
    staleness: int
    """Of the layer's stalest element (``t_fail`` minus the step of the oldest source supplying any)."""
    overlays: tuple[VersionRef, ...] = ()
    """Partial versions newer than ``version`` and at or before ``t_fail``, newest first: each
    element they hold replaces ``version``'s (the newest that holds it wins)."""
    sources: tuple[LayerSource, ...] = ()
    """Where the elements come from (overlays newest first, then ``version``); set by :func:`with_sources`."""


@dataclass(frozen=True)
class RecoveryPlan:
    """For each layer (model order) the version to load, and how stale the composite is."""

    t_fail: int
    choices: tuple[LayerChoice, ...]
    max_staleness: int
    weighted_staleness: float
    """Element-weighted once :func:`with_sources` has counted the overlays' elements."""
    passed_over: Mapping[str, str] = field(default_factory=dict)
    """Partial versions of the layers that are not used, and why (version id → reason)."""

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
    missing: list[tuple[str, str]] = []
    passed_over: dict[str, str] = {}
    for layer, candidates in by_layer.items():
        usable = [v for v in candidates if not v.partial and v.step <= t_fail and v.version_id not in skip]
        if not usable:
            tried = sorted(v.version_id for v in candidates if not v.partial and v.step <= t_fail)
            missing.append((layer, ", ".join(tried) or "no version at or before the step"))
            continue
        newest = max(usable, key=lambda v: (v.step, not v.base))
        overlays = _overlays(newest, candidates, t_fail, skip, passed_over)
        choices.append(LayerChoice(layer=layer, version=newest, staleness=t_fail - newest.step, overlays=overlays))
    if missing:
        raise NoUsableVersionError(f"cannot recover at step {t_fail}: no usable version for " + _describe(missing))
    total = sum(layer_numel.values())
    weighted = sum(layer_numel[c.layer] * c.staleness for c in choices) / total if total else 0.0
    return RecoveryPlan(
        t_fail=t_fail,
        choices=tuple(choices),
        max_staleness=max((c.staleness for c in choices), default=0),
        weighted_staleness=weighted,
        passed_over=passed_over,
    )


def _overlays(
    base: VersionRef, candidates: Iterable[VersionRef], t_fail: int, skip: Collection[str], passed_over: dict[str, str]
) -> tuple[VersionRef, ...]:
    """The layer's partial versions to overlay on ``base``, newest first; the others go to
    ``passed_over`` with the reason (skipped ones are the caller's to explain)."""
    chosen = []
    for v in candidates:
        if not v.partial or v.version_id in skip:
            continue
        if v.step > t_fail:
            # its state already holds step v.step's update: resuming at t_fail + 1 would apply it twice
            passed_over[v.version_id] = (
                f"step {v.step} is after t_fail {t_fail}: resuming at step {t_fail + 1} would apply "
                f"the updates of steps {t_fail + 1}..{v.step} twice"
            )
        elif v.step <= base.step:
            passed_over[v.version_id] = f"not newer than the whole version {base.version_id} (step {base.step})"
        else:
            chosen.append(v)
    return tuple(sorted(chosen, key=lambda v: (v.step, v.origin == "capture", v.version_id), reverse=True))


def _describe(missing: list[tuple[str, str]]) -> str:
    """``layer (tried: …)`` for each layer without a version; layers that tried the same are
    named together, a few of them only (``32 layers: block.0, block.1 … lm_head (tried: …)``)."""
    by_tried: dict[str, list[str]] = {}
    for layer, tried in missing:
        by_tried.setdefault(tried, []).append(layer)
    return "; ".join(f"{describe_layers(layers)} (tried: {tried})" for tried, layers in by_tried.items())


def with_sources(
    plan: RecoveryPlan,
    layer_numel: Mapping[str, int],
    coverage: Mapping[str, Coverage],
    ranks: Mapping[str, tuple[int, ...]] | None = None,
) -> RecoveryPlan:
    """``plan`` with each layer's :class:`LayerSource` shares and element-weighted staleness:
    ``coverage`` (overlay version id → the element spans it holds per parameter) says what each
    overlay supplies once the newer ones took theirs; the whole version supplies the rest. An
    overlay left with no element (every one it holds is in a newer one) is dropped from the
    choice and passed over, so that recovery does not read its files.
    ``ranks``: version id → the ranks whose files it holds (for the account only).

    Raises :class:`ValueError` if a layer's overlays cover more elements than the layer has."""
    ranks = ranks or {}
    choices = []
    passed_over = dict(plan.passed_over)
    for c in plan.choices:
        counts = claimed_elements(claim([coverage[o.version_id] for o in c.overlays]), len(c.overlays))
        rest = layer_numel[c.layer] - sum(counts)
        if rest < 0:
            raise ValueError(
                f"layer {c.layer}: overlays {[o.version_id for o in c.overlays]} cover {sum(counts)} elements, "
                f"the layer has {layer_numel[c.layer]}"
            )
        supplying = [(o, n) for o, n in zip(c.overlays, counts, strict=True) if n > 0]
        for o, n in zip(c.overlays, counts, strict=True):
            if n == 0:  # shadowed: reading its files would load nothing
                passed_over[o.version_id] = "newer partial versions hold every element it holds"
        sources = tuple(_source(o, n, ranks) for o, n in supplying) + (_source(c.version, rest, ranks),)
        choices.append(replace(c, overlays=tuple(o for o, _ in supplying), sources=sources))
    per_layer, weighted = element_staleness(layer_numel, {c.layer: c.sources for c in choices}, plan.t_fail)
    choices = [replace(c, staleness=per_layer[c.layer]) for c in choices]
    return replace(
        plan,
        choices=tuple(choices),
        max_staleness=max(per_layer.values(), default=0),
        weighted_staleness=weighted,
        passed_over=passed_over,
    )


def _source(v: VersionRef, elements: int, ranks: Mapping[str, tuple[int, ...]]) -> LayerSource:
    return LayerSource(
        origin=v.origin,
        version_id=v.version_id,
        step=v.step,
        ranks=tuple(ranks.get(v.version_id, ())),
        elements=elements,
        partial=v.partial,
    )


def newest_recoverable_step(layer_names: Collection[str], versions: Iterable[VersionRef]) -> int | None:
    """The newest step at which every layer has some version (over the versions found usable, the
    default ``t_fail``, where a ``--resume`` or a restarted driver continues): the step of the newest version, whole or
    partial, provided every layer has a whole version at all (a partial one holds only some
    ranks' slices). A partial version is committed only at or before the ``t_fail`` of the
    failure that left it (``CommitTracker.take_incomplete``), so its step is one the run
    reached; counting it keeps the survivors' captures of a failure whose recovery never
    finished (the driver lost during it), as the recovery itself would have."""
    names = set(layer_names)
    ours = [v for v in versions if v.layer in names]
    if not names or {v.layer for v in ours if not v.partial} != names:
        return None
    return max(v.step for v in ours)
