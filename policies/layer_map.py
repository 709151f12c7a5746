"""The module-level layers of a causal LM: the unit LayerCheck tracks and persists.

A model's trainable parameters are grouped into ``N = B + 3`` layers, in model order:
``embed``, ``block.0`` … ``block.{B-1}``, ``norm``, ``lm_head``. A tied ``lm_head`` shares its
tensor with the embedding and is not a separate layer (``named_parameters()`` lists a shared
tensor once, under its first name, so it lands in ``embed``).

Placement works from parameter names, so it covers the Llama, Mistral, Qwen2, GPT-2, GPT-NeoX,
Falcon, OPT and Phi families without per-family code: a parameter under a numbered module list
(``layers.3.``, ``h.3.``, ``blocks.3.``) belongs to that block; before the blocks it must be an
embedding; after them a final norm or the output head. Anything else raises
:class:`UnplacedParameterError` naming the parameters, rather than being silently misfiled.

A model these rules do not fit takes an explicit layer map (:func:`layer_map_from`): a dict of
layer name → parameter-name prefixes, or a function from a parameter name to its layer name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

EMBED = "embed"
NORM = "norm"
LM_HEAD = "lm_head"

_BLOCK = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|layer)\.(\d+)\.")
_EMBED = re.compile(r"(?:^|[._])(embed_tokens|embed_positions|embed_in|wte|wpe|word_embeddings|embeddings)(?:\.|$)")
_NORM = re.compile(r"(?:^|\.)(norm|ln_f|final_layer_norm|final_layernorm|final_norm)(?:\.|$)")
#: The output head, also under a wrapper's prefix (peft's ``base_model.model.``, DDP's ``module.``);
#: a bare ``output.`` only at the top (inside blocks it names other modules).
_HEAD = re.compile(r"(?:^|\.)(lm_head|embed_out)\.|^output\.")


#: Module wrappers whose attribute is no part of a parameter's name in a checkpoint, stripped from
#: every name LayerCheck records, whichever engine ran: torch.compile's ``OptimizedModule``
#: (``_orig_mod.``) and activation checkpointing's wrapper (``_checkpoint_wrapped_module.``), as torch's
#: own checkpointing strips them. A peft model's prefix (``base_model.model.``) is kept: it is part of
#: the adapter's own names, which a LoRA export writes.
WRAPPER_SEGMENTS: tuple[str, ...] = ("_orig_mod", "_checkpoint_wrapped_module")


def canonical_name(name: str) -> str:
    """``name`` without the wrappers' segments (:data:`WRAPPER_SEGMENTS`)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


class UnplacedParameterError(ValueError):
    """Parameters whose names fit none of the layers."""


#: An explicit layer map: layer name → parameter-name prefixes (``{"encoder": ["enc."], ...}``),
#: or a function from a parameter name to its layer name (``None``: unplaced).
LayerMapSpec = Mapping[str, Sequence[str]] | Callable[[str], "str | None"]

HOW_TO_MAP = (
    "pass a layer map: layer_map={'layer name': ['parameter.name.prefix', ...], ...} "
    "or layer_map=lambda param_name: 'layer name'"
)


def _unplaced_error(names: Sequence[str], why: str) -> UnplacedParameterError:
    shown = ", ".join(repr(n) for n in names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
    return UnplacedParameterError(f"cannot place {len(names)} parameter(s) in a layer: {shown} ({why}); {HOW_TO_MAP}")


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


def describe_layers(names: Sequence[str], *, most: int = 4) -> str:
    """Layers for a message a person reads: all of a few (``"block.3, norm"``), else their count
    with the first and last ones (``"32 layers: block.0, block.1 … lm_head"``)."""
    names = list(names)
    if len(names) <= most:
        return ", ".join(names) or "no layer"
    return f"{len(names)} layers: {', '.join(names[: most - 1])} … {names[-1]}"


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

    def to_json(self) -> dict[str, object]:
        return {
            "layers": [
                {
                    "name": layer.name,
                    "params": [{"name": p.name, "shape": list(p.shape), "decay": p.decay} for p in layer.params],
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
    unplaced: list[str] = []
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
            unplaced.append(name)
    if unplaced:
        raise _unplaced_error(
            unplaced,
            "not under a numbered block (layers.N / h.N / blocks.N) and not an embedding, final norm or output head",
        )
    if not blocks:
        raise UnplacedParameterError(
            "the model has no numbered transformer blocks (layers.N / h.N / blocks.N); " + HOW_TO_MAP
        )
    if sorted(blocks) != list(range(len(blocks))):
        raise UnplacedParameterError(f"transformer blocks are not numbered 0..B-1: {sorted(blocks)}")
    layers = [Layer(EMBED, tuple(embed))] if embed else []
    layers += [Layer(block_name(i), tuple(blocks[i])) for i in range(len(blocks))]
    if norm:
        layers.append(Layer(NORM, tuple(norm)))
    if head:
        layers.append(Layer(LM_HEAD, tuple(head)))
    return LayerMap(layers=tuple(layers))


def trainable_only(layer_map: LayerMap, trainable: Iterable[str]) -> LayerMap:
    """``layer_map`` without the parameters not in ``trainable``, and without the layers left empty.

    Layers keep their names (``block.2`` stays ``block.2`` when blocks 0 and 1 are frozen), so a
    frozen layer is simply absent: nothing tracks, persists or restores it, and recovery keeps the
    model's own weights for it — exact, since a frozen layer never changes after it is built.
    """
    keep = set(trainable)
    layers = [Layer(layer.name, tuple(p for p in layer.params if p.name in keep)) for layer in layer_map.layers]
    kept = tuple(layer for layer in layers if layer.params)
    if not kept:
        raise UnplacedParameterError("the model has no trainable parameters (every layer is frozen)")
    return LayerMap(layers=kept)


def layer_map_of(model: _HasNamedParameters) -> LayerMap:
    """The layer map of a live model (anything with ``named_parameters()``), trainable only.
    Layers are placed over all parameters first, so freezing some blocks leaves the others' numbers."""
    params = [(canonical_name(name), param) for name, param in model.named_parameters()]
    full = build_layer_map((name, tuple(param.shape)) for name, param in params)
    return trainable_only(full, (name for name, param in params if param.requires_grad))


def layer_map_from(params: Iterable[tuple[str, Sequence[int]]], spec: LayerMapSpec) -> LayerMap:
    """Group ``(name, shape)`` pairs by an explicit ``spec``; layers in order of first appearance.

    With a dict, a parameter belongs to the layer with the longest prefix it starts with.
    Every parameter must be placed: the error names those that are not.
    """
    assign = spec if callable(spec) else _by_prefix(spec)
    layers: dict[str, list[ParamInfo]] = {}
    unplaced: list[str] = []
    for name, shape in params:
        layer = assign(name)
        if layer is None:
            unplaced.append(name)
            continue
        layers.setdefault(str(layer), []).append(
            ParamInfo(name=name, shape=tuple(int(s) for s in shape), decay=is_decayed(name, shape))
        )
    if unplaced:
        raise _unplaced_error(unplaced, "the layer map given places them nowhere")
    if not layers:
        raise UnplacedParameterError("the layer map given places no parameters; " + HOW_TO_MAP)
    return LayerMap(layers=tuple(Layer(name, tuple(infos)) for name, infos in layers.items()))


def _by_prefix(spec: Mapping[str, Sequence[str]]) -> Callable[[str], str | None]:
    for layer, prefixes in spec.items():
        if isinstance(prefixes, str):
            raise TypeError(f"layer_map[{layer!r}]: a list of parameter-name prefixes, got the string {prefixes!r}")
    pairs = sorted(((p, layer) for layer, prefixes in spec.items() for p in prefixes), key=lambda x: -len(x[0]))

    def assign(name: str) -> str | None:
        return next((layer for prefix, layer in pairs if name.startswith(prefix)), None)

    return assign


def model_layer_map(model: _HasNamedParameters, spec: LayerMapSpec | None = None) -> LayerMap:
    """The layer map of a live model's trainable parameters: by ``spec`` if given, else by name.
    Shapes are the full ones also under ZeRO-3, where a module's parameters are empty partitions
    (and FSDP2's DTensors report theirs); names are :func:`canonical_name`'s."""
    named = [(canonical_name(name), param) for name, param in model.named_parameters()]
    trainable = [name for name, param in named if param.requires_grad]
    if spec is not None:
        keep = set(trainable)
        return layer_map_from([(name, _full_shape(param)) for name, param in named if name in keep], spec)
    return trainable_only(build_layer_map((name, _full_shape(param)) for name, param in named), trainable)


def _full_shape(param: Any) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", param.shape))
