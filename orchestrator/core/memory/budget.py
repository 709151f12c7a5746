"""Whether ``persistence.memory_period`` can keep its promise with ``persistence.memory_bytes``,
told at a run's start with the budget it needs.

A memory version is every layer's state, every ``memory_period`` steps, held only in the writers'
memory. A recovery takes a layer's memory version only while the writers hold every rank's file
of it, so a writer's budget must hold, for every layer at once, the files of the ranks it serves,
and where it keeps mirror copies (``persistence.memory_mirror``, more than one node) those of its
peer's ranks too. The copies of stored versions' files it also keeps go first when the budget is
short (:mod:`layercheck.orchestrator.core.memory.tier`), so they need no room of their own; nor do
the snapshots queued for storage (bounded apart, by ``persistence.max_inflight_bytes``).

A budget short of that breaks the promise for some layers at every period: their lost slices come
back from older versions. Pure arithmetic over the layer sizes the driver knows; no Ray.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from layercheck.policies.staggered import BYTES_PER_PARAM

logger = logging.getLogger(__name__)

#: Room for one shard file's header beside its tensors: about 0.5 KiB per parameter tensor
#: (its three state tensors' offsets and checksums, its slice), so a layer of up to ~30 parameters.
FILE_HEADER_BYTES = 16 * 2**10


@dataclass(frozen=True, kw_only=True)
class MemoryVersionNeed:
    """What one writer must hold to keep a whole memory version of the ranks it serves."""

    ranks: int
    """Ranks whose files of every layer one writer holds: its own, and its peer's where mirrored."""
    world_size: int
    nbytes: int
    """Bytes of those files: the ranks' slices of every layer (weights and both Adam moments in
    fp32) and their files' headers."""


def ranks_per_writer(world_size: int, writers_per_node: int, *, mirrored: bool, per_node: int | None = None) -> int:
    """The most ranks whose files one writer holds: a rank uses writer ``rank % writers_per_node``
    of its node, and Ray Train packs the ranks on as few nodes as fit, so at worst as many as one
    node holds (``per_node``, :func:`most_ranks_on_a_node`; ``None``: all on one);
    ``mirrored`` (mirror copies to another node's writer) adds a peer's as many again, and at one
    writer per node own and mirrored ranks are together at most the world."""
    on_a_node = world_size if per_node is None else max(1, min(world_size, per_node))
    own = math.ceil(on_a_node / writers_per_node)
    return min(world_size, 2 * own) if mirrored else own


def most_ranks_on_a_node(world_size: int, per_worker: Mapping[str, float], nodes: Sequence[Mapping[str, float]]) -> int:
    """The most of ``world_size`` workers, each asking ``per_worker`` resources (``{"GPU": 1}``), that
    one of ``nodes`` (each node's total resources) can hold: at 1,024 GPUs on nodes of 8, 8, not 1,024.
    Without nodes, or without a resource that bounds it, the whole world."""
    asked = {name: amount for name, amount in per_worker.items() if amount > 0}
    if not nodes or not asked:
        return world_size
    fits = [min(int(node.get(name, 0.0) // amount) for name, amount in asked.items()) for node in nodes]
    return max(1, min(world_size, max(fits)))


def memory_version_need(layer_numel: Mapping[str, int], *, world_size: int, ranks: int) -> MemoryVersionNeed:
    """The bytes of one memory version of ``ranks`` ranks of ``world_size``: each rank's share of a
    layer is at most ``ceil(numel / world_size)`` elements (ZeRO and FSDP2 cut a layer evenly; a
    ZeRO-0 rank persists the slice it owns)."""
    per_rank = sum(math.ceil(n / world_size) * BYTES_PER_PARAM + FILE_HEADER_BYTES for n in layer_numel.values())
    return MemoryVersionNeed(ranks=ranks, world_size=world_size, nbytes=ranks * per_rank)


def memory_promise_problem(
    layer_numel: Mapping[str, int], *, memory_period: int, memory_bytes: int, world_size: int, ranks: int
) -> str:
    """Why ``memory_period`` (``persistence.memory_period``) cannot be kept with ``memory_bytes``
    (``persistence.memory_bytes``, per writer): one line, with the budget it needs; "" where it
    can, or memory versions are off. ``ranks``: those one writer holds (:func:`ranks_per_writer`)."""
    if not memory_period:
        return ""
    need = memory_version_need(layer_numel, world_size=world_size, ranks=ranks)
    if need.nbytes <= memory_bytes:
        return ""
    return (
        f"persistence.memory_period = {memory_period} cannot be kept: a memory version of the {need.ranks} "
        f"rank(s) of {world_size} one writer holds is {_size(need.nbytes)} ({len(layer_numel)} layers' weights and "
        f"Adam moments in fp32, with file headers), beyond persistence.memory_bytes = {memory_bytes} "
        f"({_size(memory_bytes)}); set persistence.memory_bytes >= {need.nbytes} to keep it. Until then some "
        "layers' lost slices come back from older versions, more than memory_period steps stale (each "
        "recovery's summary says how many)"
    )


def warn_if_unkept(
    layer_numel: Mapping[str, int], *, memory_period: int, memory_bytes: int, world_size: int, ranks: int
) -> str:
    """Log :func:`memory_promise_problem` as a warning at a run's start; returns it ("": none).
    A warning, not an error: the need is a bound over where Ray places the ranks (it may
    overstate it on several nodes), and a run short of it still recovers, only staler, and says
    so per recovery in its summary."""
    problem = memory_promise_problem(
        layer_numel, memory_period=memory_period, memory_bytes=memory_bytes, world_size=world_size, ranks=ranks
    )
    if problem:
        logger.warning("%s", problem)
    return problem


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
