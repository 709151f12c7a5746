"""Retention by reachability: which committed versions some possible recovery point still needs.

Pure: it takes the committed versions as values and returns which to keep. "Keep the last N
steps" is wrong for layer-wise checkpoints — a slow layer's only version may be 900 steps old
and still be the one every recovery uses. Instead a version is kept while

* some recovery point in the window needs it: for every step ``t`` in
  ``[newest - window, newest]`` (``newest`` = the newest recoverable step), the version
  :func:`~layercheck.policies.plan.plan_recovery` would choose for each layer at ``t`` — which includes the
  newest version of every layer (``t = newest``); or
* it is part of the base checkpoint and some layer has no version newer than its base yet; or
* it is a partial version (a survivor's capture: only some ranks' slices) and no whole version
  of its layer at or after its step exists yet — recovery overlays it on the whole version
  under it. Partial versions never count as a layer's version for the rules above, so they
  never make an older whole version deletable.

Versions at ``t`` are chosen like ``plan_recovery`` does (newest step, a non-base version
before a base one at the same step); versions that tie exactly are all kept.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from layercheck.policies.plan import VersionRef, newest_recoverable_step


@dataclass(frozen=True, kw_only=True)
class RetentionConfig:
    window: int = 0
    """Recovery window in steps: every step in [newest - window, newest] stays recoverable."""

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"window must be an integer >= 0 (steps), got {self.window!r}")


@dataclass(frozen=True, kw_only=True)
class RetentionDecision:
    """Which version ids to keep (each with its reason) and which are unreachable."""

    newest_step: int | None
    keep: dict[str, str] = field(default_factory=dict)
    delete: frozenset[str] = frozenset()


def _key(v: VersionRef) -> tuple[int, bool]:
    # plan_recovery's order: the newest step, a non-base version before a base one
    return (v.step, not v.base)


def _window_needs(candidates: list[VersionRef], low: int, high: int) -> dict[str, str]:
    """The versions of one layer chosen at some step of [low, high]."""
    needed: dict[str, str] = {}
    at_or_before_low = [v for v in candidates if v.step <= low]
    if at_or_before_low:
        best = max(_key(v) for v in at_or_before_low)
        needed.update({v.version_id: f"chosen for recovery at step {low}" for v in at_or_before_low if _key(v) == best})
    inside = [v for v in candidates if low < v.step <= high]
    for step in {v.step for v in inside}:
        same = [v for v in inside if v.step == step]
        best = max(_key(v) for v in same)
        needed.update({v.version_id: f"chosen for recovery at step {step}" for v in same if _key(v) == best})
    return needed


def _base_needs(by_layer: dict[str, list[VersionRef]]) -> dict[str, str]:
    """The newest base version of every layer, while some layer has nothing newer than its base."""
    newest_base = {}
    for layer, candidates in by_layer.items():
        bases = [v for v in candidates if v.base]
        if bases:
            newest_base[layer] = max(bases, key=lambda v: v.step)
    waiting = [
        layer
        for layer, base in newest_base.items()
        if not any(not v.base and v.step > base.step for v in by_layer[layer])
    ]
    if not waiting:
        return {}
    reason = f"base checkpoint: layer(s) {', '.join(sorted(waiting))} have no newer version yet"
    return {base.version_id: reason for base in newest_base.values()}


def _partial_needs(refs: list[VersionRef], by_layer: dict[str, list[VersionRef]]) -> dict[str, str]:
    """Partial versions no whole version of their layer has caught up with yet."""
    needed = {}
    for v in refs:
        if v.partial and not any(w.step >= v.step for w in by_layer.get(v.layer, ())):
            needed[v.version_id] = (
                f"partial version ({v.origin}) at step {v.step}: no whole version of {v.layer} at or after it yet"
            )
    return needed


def plan_retention(
    versions: Iterable[VersionRef],
    *,
    config: RetentionConfig,
    layers: Collection[str] | None = None,
    unusable: Mapping[str, str] | None = None,
) -> RetentionDecision:
    """Decide what to keep. ``layers`` defaults to every layer that has a version; until every
    one of them has a *usable* version there is no recovery point yet, and everything is kept.

    ``unusable`` (version id → why) are versions found damaged: the plan is made as if they did
    not exist — so the older version a recovery would fall back to is kept in their place — and
    they are kept too (evidence for ``layercheck verify``; GC deletes only what it can prove unneeded)."""
    refs = list(versions)
    unusable = unusable or {}
    names = list(layers) if layers is not None else list(dict.fromkeys(v.layer for v in refs))
    damaged = {
        v.version_id: f"damaged ({unusable[v.version_id]}): kept for inspection"
        for v in refs
        if v.version_id in unusable
    }
    refs = [v for v in refs if v.version_id not in unusable]
    newest = newest_recoverable_step(names, refs)
    if newest is None:
        return RetentionDecision(
            newest_step=None, keep={**{v.version_id: "no recovery point yet" for v in refs}, **damaged}
        )
    by_layer: dict[str, list[VersionRef]] = {}
    for v in refs:
        if not v.partial:
            by_layer.setdefault(v.layer, []).append(v)
    keep: dict[str, str] = dict(damaged)
    keep.update(_partial_needs(refs, by_layer))
    for candidates in by_layer.values():
        keep.update(_window_needs(candidates, newest - config.window, newest))
    for version_id, reason in _base_needs(by_layer).items():
        keep.setdefault(version_id, reason)
    delete = frozenset(v.version_id for v in refs if v.version_id not in keep)
    return RetentionDecision(newest_step=newest, keep=keep, delete=delete)
