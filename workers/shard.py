"""One rank's shard of one layer's state, in host memory: the unit that is snapshotted,
handed to the persistence pool, written to storage and loaded back.

The format is independent of ZeRO stage and world size: for each parameter it records which
contiguous run of the *flattened* parameter this rank holds (``offset``, ``length``) and the
parameter's global shape, so a reader at another world size can re-slice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where tensors are made: readers of shard headers (the supervisor) go without it
    import torch

#: The per-element state tensors of a layer: fp32 master weights and Adam's two moments.
STATE_KEYS: tuple[str, ...] = ("fp32", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class ParamSlice:
    """Where this rank's elements of one parameter sit in the flattened parameter."""

    name: str
    shape: tuple[int, ...]
    offset: int
    length: int


@dataclass
class LayerShard:
    """This rank's part of one layer's state, taken after the optimizer step ``step``.

    ``tensors[key]`` (one per :data:`STATE_KEYS`) is a flat 1-D float32 tensor: the slices of
    ``slices`` concatenated in order. ``groups`` are the layer's optimizer param-group
    hyper-parameters (JSON-safe: lr, betas, eps, weight_decay, name, the names of their params).
    """

    layer: str
    step: int
    rank: int
    world_size: int
    slices: tuple[ParamSlice, ...]
    tensors: dict[str, torch.Tensor]
    optimizer_step: int
    groups: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        import torch  # loaded already: the tensors are torch's

        expected = sum(s.length for s in self.slices)
        for key in STATE_KEYS:
            tensor = self.tensors.get(key)
            if tensor is None:
                raise ValueError(f"layer {self.layer!r} shard is missing state {key!r}")
            if tensor.dim() != 1 or tensor.numel() != expected or tensor.dtype != torch.float32:
                raise ValueError(
                    f"layer {self.layer!r} state {key!r} must be flat float32 of {expected} elements, "
                    f"got {tuple(tensor.shape)} {tensor.dtype}"
                )

    @property
    def numel(self) -> int:
        return sum(s.length for s in self.slices)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def view(self, key: str, index: int) -> torch.Tensor:
        """The elements of ``slices[index]`` in state ``key`` (a view, no copy)."""
        start = sum(s.length for s in self.slices[:index])
        return self.tensors[key][start : start + self.slices[index].length]
