"""A rank's state layout of one layer ``a`` with one fp32 parameter, for the loop's unit tests."""

from __future__ import annotations

import torch

from layercheck.policies.layer_map import Layer, LayerMap, ParamInfo
from layercheck.workers.layout import LayerLayout, ParamSlice, Piece, StateLayout


def one_layer_layout(param: torch.nn.Parameter, optimizer: torch.optim.Optimizer) -> StateLayout:
    """``param`` (1-D) as layer ``a``'s one parameter, owned whole by the only rank, under ``optimizer``."""
    (numel,) = param.shape
    piece = Piece(ParamSlice("a.0", (numel,), 0, numel), param, 0)
    return StateLayout(
        stage=1,
        rank=0,
        world_size=1,
        layers={"a": LayerLayout(name="a", owned=(piece,), needed=(), masters=(param,), groups=())},
        layer_map=LayerMap((Layer("a", (ParamInfo("a.0", (numel,), True),)),)),
        optimizer=optimizer,
    )
