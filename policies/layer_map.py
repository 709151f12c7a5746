"""The module-level layers of a causal LM: the unit LayerCheck tracks and persists.

A model's trainable parameters are grouped into ``N = B + 3`` layers, in model order:
``embed``, ``block.0`` … ``block.{B-1}``, ``norm``, ``lm_head``. A tied ``lm_head`` shares its
tensor with the embedding and is not a separate layer (``named_parameters()`` lists a shared
tensor once, under its first name, so it lands in ``embed``).

Placement works from parameter names, so it covers the Llama, Mistral, Qwen2, GPT-2, GPT-NeoX,
Falcon, OPT and Phi families without per-family code: a parameter under a numbered module list
(``layers.3.``, ``h.3.``, ``blocks.3.``) belongs to that block; before the blocks it must be an
embedding; after them a final norm or the output head. Anything else raises
:class:`UnplacedParameterError` naming the parameter, rather than being silently misfiled.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

EMBED = "embed"
NORM = "norm"
LM_HEAD = "lm_head"

_BLOCK = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|layer)\.(\d+)\.")
_EMBED = re.compile(r"(?:^|[._])(embed_tokens|embed_positions|embed_in|wte|wpe|word_embeddings|embeddings)(?:\.|$)")
_NORM = re.compile(r"(?:^|\.)(norm|ln_f|final_layer_norm|final_layernorm|final_norm)(?:\.|$)")
_HEAD = re.compile(r"^(lm_head|embed_out|output)\.")


class UnplacedParameterError(ValueError):
    """A parameter whose name fits none of the layer kinds."""


def block_name(index: int) -> str:
    return f"block.{index}"


@dataclass(frozen=True)
class ParamInfo:
    """One trainable parameter: its full name, shape and weight-decay class."""

    name: str
    shape: tuple[int, ...]
    decay: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Layer:
    """One persistable unit: a name and its parameters in model order."""

    name: str
    params: tuple[ParamInfo, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def decay_params(self) -> tuple[ParamInfo, ...]:
        return tuple(p for p in self.params if p.decay)

    @property
    def no_decay_params(self) -> tuple[ParamInfo, ...]:
        return tuple(p for p in self.params if not p.decay)


@dataclass(frozen=True)
class LayerMap:
    """The model's layers in model order, and the way back from a parameter to its layer."""

    layers: tuple[Layer, ...]

    def __post_init__(self) -> None:
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate layer names in {names}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.layers)

    @property
    def numel(self) -> dict[str, int]:
        return {layer.name: layer.numel for layer in self.layers}

    @property
    def total_numel(self) -> int:
        return sum(layer.numel for layer in self.layers)

    def __getitem__(self, name: str) -> Layer:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"no layer {name!r}; layers are {list(self.names)}")

    def layer_of(self, param_name: str) -> str:
        for layer in self.layers:
            if any(p.name == param_name for p in layer.params):
                return layer.name
        raise KeyError(f"parameter {param_name!r} is in no layer")

    def to_json(self) -> dict[str, Any]:
        return {
            "layers": [
                {
                    "name": layer.name,
                    "params": [
                        {"name": p.name, "shape": list(p.shape), "decay": p.decay} for p in layer.params
                    ],
                }
                for layer in self.layers
            ]
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LayerMap:
        return cls(
            layers=tuple(
                Layer(
                    name=layer["name"],
                    params=tuple(
                        ParamInfo(name=p["name"], shape=tuple(p["shape"]), decay=bool(p["decay"]))
                        for p in layer["params"]
                    ),
                )
                for layer in data["layers"]
            )
        )


class _HasNamedParameters(Protocol):
    def named_parameters(self) -> Iterable[tuple[str, Any]]: ...


def is_decayed(name: str, shape: Sequence[int]) -> bool:
    """Weight decay applies to matrices; biases, norm weights and other vectors go without."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias" or len(shape) < 2:
        return False
    return "norm" not in name and ".ln_" not in name


def build_layer_map(params: Iterable[tuple[str, Sequence[int]]]) -> LayerMap:
    """Group ``(name, shape)`` pairs, in model order, into the module-level layers."""
    embed: list[ParamInfo] = []
    blocks: dict[int, list[ParamInfo]] = {}
    norm: list[ParamInfo] = []
    head: list[ParamInfo] = []
    for name, shape in params:
        info = ParamInfo(name=name, shape=tuple(int(s) for s in shape), decay=is_decayed(name, shape))
        block = _BLOCK.search(name)
        if block is not None:
            blocks.setdefault(int(block.group(1)), []).append(info)
        elif _HEAD.search(name):
            head.append(info)
        elif _NORM.search(name):
            norm.append(info)
        elif _EMBED.search(name):
            embed.append(info)
        else:
            raise UnplacedParameterError(
                f"cannot place parameter {name!r} in a layer: it is not under a numbered block "
                "(layers.N / h.N / blocks.N) and is not an embedding, final norm or output head"
            )
    if not blocks:
        raise UnplacedParameterError("the model has no numbered transformer blocks (layers.N / h.N / blocks.N)")
    if sorted(blocks) != list(range(len(blocks))):
        raise UnplacedParameterError(f"transformer blocks are not numbered 0..B-1: {sorted(blocks)}")
    layers = [Layer(EMBED, tuple(embed))] if embed else []
    layers += [Layer(block_name(i), tuple(blocks[i])) for i in range(len(blocks))]
    if norm:
        layers.append(Layer(NORM, tuple(norm)))
    if head:
        layers.append(Layer(LM_HEAD, tuple(head)))
    return LayerMap(layers=tuple(layers))


def layer_map_of(model: _HasNamedParameters) -> LayerMap:
    """The layer map of a live model (anything with ``named_parameters()``), trainable only."""
    return build_layer_map(
        (name, tuple(param.shape)) for name, param in model.named_parameters() if param.requires_grad
    )
