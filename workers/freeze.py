"""Frozen layers and layer-wise learning-rate decay: what ``model.freeze`` and
``optim.layer_lr_decay`` do to a built model and its param groups.

Both are expressed over LayerCheck's layer names (``embed``, ``block.N``, ``norm``,
``lm_head``), placed over *all* of the model's parameters, so a pattern means the same layer
whatever else is frozen.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Sequence

import torch

from layercheck.policies.config_loader import ConfigError
from layercheck.policies.layer_map import EMBED, LayerMap, build_layer_map

logger = logging.getLogger(__name__)


def frozen_layers(layer_map: LayerMap, patterns: Sequence[str]) -> tuple[str, ...]:
    """The layers of ``layer_map`` (all parameters) that ``patterns`` name, in model order.

    Raises :class:`ConfigError` naming ``model.freeze`` for a pattern that matches no layer
    (a typo would otherwise silently train everything) and when nothing would stay trainable.
    """
    names = layer_map.names
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise ConfigError(f"model.freeze: {pattern!r} matches no layer; the model's layers are {list(names)}")
    frozen = tuple(n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns))
    if len(frozen) == len(names):
        raise ConfigError(f"model.freeze: {list(patterns)} freezes every layer; at least one must train")
    return frozen


def apply_freeze(model: torch.nn.Module, patterns: Sequence[str]) -> tuple[str, ...]:
    """Set ``requires_grad=False`` on every parameter of the layers ``patterns`` name; those layers."""
    if not patterns:
        return ()
    params = dict(model.named_parameters())
    full = build_layer_map((name, tuple(p.shape)) for name, p in params.items())
    frozen = frozen_layers(full, patterns)
    for name in frozen:
        for info in full[name].params:
            params[info.name].requires_grad_(False)
    logger.info(
        "froze %d layer(s) (%d parameters) for model.freeze=%s: %s",
        len(frozen),
        sum(full[n].numel for n in frozen),
        list(patterns),
        list(frozen),
    )
    return frozen


def lr_scale(layer: str, num_blocks: int, decay: float) -> float:
    """The factor on the peak lr of ``layer`` under layer-wise decay ``decay`` (see
    ``OptimConfig.layer_lr_decay``): ``block.i`` ``decay**(B-1-i)``, ``embed`` ``decay**B``,
    anything else (``norm``, ``lm_head``, a custom layer) 1."""
    if decay == 1.0:
        return 1.0
    if layer == EMBED:
        return decay**num_blocks
    if layer.startswith("block."):
        return decay ** (num_blocks - 1 - int(layer.split(".", 1)[1]))
    return 1.0
