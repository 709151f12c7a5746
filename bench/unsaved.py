"""Ground truth of what a recovery lost: the unsaved drift at recovery, measured on the state.

Before a failure wipes the training state, every rank copies the fp32 master weights it owns
(:func:`owned_weights`; each element is owned by exactly one rank, at every ZeRO stage); once the
strategy has recovered, :func:`unsaved_at_recovery` compares the state it loaded with that copy.
The distance is the design's drift unit: per layer ``sum |θ_recovered − θ_true| / numel`` (the
mean absolute difference per element), and over the model the parameter-weighted mean (total L1
over total elements). Unlike the freshness tracker's unsaved drift (the per-step drifts summed
since a layer's last save, an upper bound), this is the distance itself, and it sees what the
tracker cannot: the slices a survivor's capture brought back (:mod:`layercheck.workers.capture`).

Collective: every rank calls :func:`unsaved_at_recovery` at the same point.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from layercheck.workers.layout import StateLayout, state_view


@torch.no_grad()
def owned_weights(layout: StateLayout) -> dict[str, torch.Tensor]:
    """This rank's owned fp32 master weights of every layer: one flat host copy per layer."""
    out = {}
    for name in layout.layer_map.names:
        owned = layout[name].owned
        views = [state_view(layout.optimizer, p, "fp32").reshape(-1).to("cpu", torch.float32) for p in owned]
        out[name] = torch.cat(views) if views else torch.empty(0)
    return out


@torch.no_grad()
def unsaved_at_recovery(layout: StateLayout, truth: Mapping[str, torch.Tensor], *, lost_rank: int) -> dict[str, Any]:
    """The L1 distance of the state now (recovered) from ``truth`` (:func:`owned_weights` before
    the failure), per layer, per rank and in all; ``lost_rank``: the rank that died (its elements
    are the ones no survivor held). Collective; every rank gets the same answer."""
    now = owned_weights(layout)
    mine = {name: (float((now[name] - truth[name]).abs().sum()), int(truth[name].numel())) for name in truth}
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    return summarize(gathered, lost_rank=lost_rank)


def summarize(per_rank: list[Mapping[str, tuple[float, int]]], *, lost_rank: int) -> dict[str, Any]:
    """From each rank's ``{layer: (l1, numel)}`` to the report's figures (pure)."""
    layers: dict[str, dict[str, float]] = {}
    for name in per_rank[0]:
        l1 = sum(r[name][0] for r in per_rank)
        numel = sum(r[name][1] for r in per_rank)
        layers[name] = {"l1": l1, "mean_abs": _per(l1, numel), "numel": numel}
    ranks: list[dict[str, float]] = []
    for r in per_rank:
        l1, numel = sum(v[0] for v in r.values()), sum(v[1] for v in r.values())
        ranks.append({"l1": l1, "mean_abs": _per(l1, numel), "numel": numel})
    survivors = [r for i, r in enumerate(ranks) if i != lost_rank]
    total_l1 = sum(r["l1"] for r in ranks)
    total_numel = sum(r["numel"] for r in ranks)
    surviving_l1 = sum(r["l1"] for r in survivors)
    surviving_numel = sum(r["numel"] for r in survivors)
    return {
        "l1": total_l1,
        "mean_abs": _per(total_l1, total_numel),
        "survivors_mean_abs": _per(surviving_l1, surviving_numel),
        "lost_mean_abs": ranks[lost_rank]["mean_abs"],
        "lost_rank": lost_rank,
        "layers": layers,
        "ranks": ranks,
    }


def _per(l1: float, numel: float) -> float:
    return l1 / numel if numel else 0.0
