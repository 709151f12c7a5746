"""The differential baseline's per-step delta, in the spirit of LowDiff: top-k sparsification
with error feedback.

For every state tensor of a rank's layer shard (fp32 weights, both Adam moments) the encoder
keeps a *shadow*: the state a recovery would rebuild (the last full checkpoint plus every
delta sent since). Each step it sends the ``k`` largest entries of ``state - shadow`` (indices
int32, values bf16) and adds exactly what it sent to the shadow, so what is not sent now is
carried into later steps (error feedback) and the reconstruction error stays bounded by the
unsent residual instead of accumulating. Recovery loads the last full checkpoint and adds the
decoded deltas in order, which reproduces the shadow bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from layercheck.workers.shard import STATE_KEYS, LayerShard


def top_k_count(numel: int, density: float) -> int:
    return min(numel, max(1, math.ceil(numel * density))) if numel else 0


def encode(current: torch.Tensor, shadow: torch.Tensor, density: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k entries of ``current - shadow`` as (int32 indices, bf16 values); updates
    ``shadow`` in place by exactly the decoded values."""
    diff = current - shadow
    k = top_k_count(diff.numel(), density)
    if k == 0:
        return torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.bfloat16)
    index = torch.topk(diff.abs(), k, sorted=False).indices
    values = diff[index].to(torch.bfloat16)
    shadow.index_add_(0, index, values.float())
    return index.to(torch.int32), values


def apply(state: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """Add a decoded delta to ``state`` in place (the same operation :func:`encode` did on the shadow)."""
    state.index_add_(0, index.long(), values.float())


class DeltaEncoder:
    """Shadows of one rank's layer shards and the per-step encoding against them."""

    def __init__(self, density: float) -> None:
        self.density = density
        self.shadow: dict[tuple[str, str], torch.Tensor] = {}

    def reset(self, shards: Iterable[LayerShard]) -> None:
        """The shadow becomes ``shards`` (a full checkpoint was just taken of exactly them)."""
        self.reset_tensors({(shard.layer, key): shard.tensors[key] for shard in shards for key in STATE_KEYS})

    def reset_tensors(self, tensors: Mapping[tuple[str, str], torch.Tensor]) -> None:
        """The shadow becomes a copy of ``tensors`` ((layer, state key) -> flat tensor, any device)."""
        for name, tensor in tensors.items():
            self.shadow[name] = tensor.detach().clone()

    def encode(self, shards: Iterable[LayerShard]) -> dict[str, torch.Tensor]:
        """This step's delta of every shard, as named tensors (``<layer>.<key>.idx|val``)."""
        return self.encode_tensors({(shard.layer, key): shard.tensors[key] for shard in shards for key in STATE_KEYS})

    def encode_tensors(self, tensors: Mapping[tuple[str, str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """This step's delta of ``tensors`` (on their device, against the shadow), in host memory."""
        out: dict[str, torch.Tensor] = {}
        for (layer, key), tensor in tensors.items():
            index, values = encode(tensor, self.shadow[(layer, key)], self.density)
            out[f"{layer}.{key}.idx"] = index.cpu()
            out[f"{layer}.{key}.val"] = values.cpu()
        return out


def delta_path(root: Path, step: int, rank: int) -> Path:
    return root / f"delta-{step:010d}-rank{rank:05d}.safetensors"


def write_delta(root: Path, step: int, rank: int, tensors: Mapping[str, torch.Tensor]) -> int:
    """Write one step's delta atomically; bytes written."""
    from safetensors.torch import save_file

    final = delta_path(root, step, rank)
    tmp = final.with_name(final.name + ".tmp")
    save_file(dict(tensors), str(tmp))
    tmp.replace(final)
    return final.stat().st_size


def replay(shards: Iterable[LayerShard], root: Path, steps: Iterable[int], rank: int) -> int:
    """Apply the deltas of ``steps`` (in order) to ``shards`` in place; the number applied."""
    from safetensors.torch import load_file

    shards = list(shards)
    count = 0
    for step in steps:
        tensors = load_file(str(delta_path(root, step, rank)))
        for shard in shards:
            for key in STATE_KEYS:
                apply(shard.tensors[key], tensors[f"{shard.layer}.{key}.idx"], tensors[f"{shard.layer}.{key}.val"])
        count += 1
    return count
