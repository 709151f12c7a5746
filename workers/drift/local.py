"""The tensors the drift probes compute on: a DTensor's local shard (FSDP2), any other tensor itself.

FSDP2's masters are its DTensor parameters (they key the optimizer's state, and their moments
are DTensors placed alike). An op on a DTensor goes through DTensor's dispatch: a sharding
propagation per op, and a view of the flattened master means the global tensor, not this rank's
shard (an unevenly sharded one cannot even be flattened). A probe's windows are runs of this
rank's local elements, so every probe reads, copies and steps the local tensors
(:func:`~layercheck.workers.layout.local_part`), op for op what DTensor would have run on them.

FSDP2 may give a parameter a new local tensor while the DTensor stays the same object (so the
optimizer's state still finds it): it re-pads an uneven shard into new memory when the local
tensor it holds is no longer its own (at lazy initialisation, after ``load_state_dict``, in
``_apply``), and a load with ``assign=True`` under torch's swap-tensors mode swaps it outright. A
view kept from before would watch memory nothing updates any more: :class:`LocalTensors` tells a
probe that keeps views when to take them again.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)


def local_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`~layercheck.workers.layout.local_part` of each tensor, in order: the grad mode set
    once for all (a step reads hundreds; entering it per tensor cost 1 µs each)."""
    with torch.no_grad():  # to_local() then hands back the local tensor itself
        return [t if (to_local := getattr(t, "to_local", None)) is None else to_local() for t in tensors]


def has_dtensors(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``tensors`` is a DTensor (one with a local part)."""
    return any(hasattr(t, "to_local") for t in tensors)


class LocalTensors:
    """The local tensor each DTensor among some tensors holds, to notice when FSDP2 swapped one.
    Plain tensors are not watched: with none among them, :meth:`swapped` costs nothing."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        unique = {id(t): t for t in tensors}.values()  # (by id: tensors compare elementwise)
        self._tensors = [t for t in unique if hasattr(t, "to_local")]
        self._held = local_tensors(self._tensors)

    def swapped(self) -> bool:
        """Whether a watched tensor holds another local tensor than when last asked (the new ones
        are then those held)."""
        if not self._tensors:
            return False
        now = local_tensors(self._tensors)
        moved = sum(map(operator.is_not, now, self._held))
        if moved:
            logger.info("drift probe: %d of %d local shards were swapped for new tensors", moved, len(now))
            self._held = now
        return bool(moved)
