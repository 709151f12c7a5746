"""Element ranges of a layer's recovery: which source supplies which elements.

A layer's recovery starts from a whole version (the *base* of the layer's choice) and overlays
partial versions on it — a survivor's capture holds only the slices its rank owned. Each element
comes from the newest source that holds it; :func:`claim` works that out from the element spans
each overlay covers, and :class:`LayerSource` is one source's share of a layer, with its step.

Pure: spans in, claims out; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

Span = tuple[int, int]
"""Elements ``[start, end)`` of one flattened parameter."""
Coverage = Mapping[str, Sequence[Span]]
"""param → the spans of it a version holds."""


@dataclass(frozen=True, order=True)
class Claim:
    """Elements ``[start, end)`` of a parameter come from overlay ``source`` (its index, newest first)."""

    start: int
    end: int
    source: int


@dataclass(frozen=True, kw_only=True)
class LayerSource:
    """One source's share of a layer's recovered state."""

    origin: str
    """``capture`` (a survivor's hand-over) or ``policy`` (a scheduled snapshot)."""
    version_id: str
    step: int
    ranks: tuple[int, ...]
    """The ranks whose files the version holds."""
    elements: int
    """Elements of the layer it supplies, after newer sources took theirs."""
    partial: bool = False

    def to_json(self) -> dict[str, object]:
        return asdict(self) | {"ranks": list(self.ranks)}


def merge_spans(spans: Iterable[Span]) -> list[Span]:
    """Sorted, disjoint, non-empty spans covering the same elements (touching spans joined)."""
    out: list[Span] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _subtract(span: Span, taken: Sequence[Span]) -> list[Span]:
    """The parts of ``span`` outside ``taken`` (sorted, disjoint)."""
    start, end = span
    out: list[Span] = []
    for t_start, t_end in taken:
        if t_end <= start:
            continue
        if t_start >= end:
            break
        if t_start > start:
            out.append((start, t_start))
        start = max(start, t_end)
        if start >= end:
            break
    if start < end:
        out.append((start, end))
    return out


def claim(coverages: Sequence[Coverage]) -> dict[str, tuple[Claim, ...]]:
    """Per parameter, which overlay supplies which elements: ``coverages`` newest first, each
    element claimed by the first that covers it. Elements no claim names come from the base."""
    params = sorted({param for coverage in coverages for param in coverage})
    out: dict[str, tuple[Claim, ...]] = {}
    for param in params:
        taken: list[Span] = []
        claims: list[Claim] = []
        for index, coverage in enumerate(coverages):
            fresh = [piece for span in merge_spans(coverage.get(param, ())) for piece in _subtract(span, taken)]
            claims += [Claim(start, end, index) for start, end in fresh]
            taken = merge_spans(taken + fresh)
        out[param] = tuple(sorted(claims))
    return out


def claimed_elements(claims: Mapping[str, Sequence[Claim]], sources: int) -> list[int]:
    """Elements each of ``sources`` overlays supplies."""
    counts = [0] * sources
    for param_claims in claims.values():
        for c in param_claims:
            counts[c.source] += c.end - c.start
    return counts


def element_staleness(
    layer_numel: Mapping[str, int], sources: Mapping[str, Sequence[LayerSource]], t_fail: int
) -> tuple[dict[str, int], float]:
    """Per layer the staleness of its stalest element (``t_fail - step`` of the oldest source
    that supplies any), and the element-weighted mean staleness over all layers."""
    per_layer: dict[str, int] = {}
    weighted = 0.0
    for layer, layer_sources in sources.items():
        supplying = [s for s in layer_sources if s.elements > 0] or list(layer_sources)
        per_layer[layer] = max((t_fail - s.step for s in supplying), default=0)
        weighted += sum(s.elements * (t_fail - s.step) for s in layer_sources)
    total = sum(layer_numel[layer] for layer in sources)
    return per_layer, (weighted / total if total else 0.0)
