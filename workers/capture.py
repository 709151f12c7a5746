"""Survivor capture: what a rank hands over when its worker group breaks under it.

When a peer dies, a surviving rank's next collective raises (gloo: tens of milliseconds after
the death) while its own optimizer state still stands at its last completed step. That state is
fresher than anything persisted, so before the rank exits it copies the slices it holds of every
layer out of the optimizer (fp32 masters and both Adam moments, the same
:class:`~layercheck.workers.shard.LayerShard` a scheduled snapshot makes) and hands them to its writer,
which persists them as a *partial* version (``origin="capture"``). Recovery overlays those
slices on the layers' whole versions, so only the dead ranks' slices come back stale.

What a rank captures:

* ZeRO 1-3, FSDP2: its own partition (the only copy of those elements anywhere); under HSDP its
  whole shard, which its replicas hold too (each writes only a run of it): a lost replica's run
  comes back from any live twin, exact;
* ZeRO-0 (every rank holds everything): the slice it owns and its neighbours' (ranks ``r - 1``
  and ``r + 1``: one contiguous run of each parameter, as a shard lists a parameter once), so any
  single death is covered by either neighbour at ``3/W`` of the model per survivor, not a whole
  copy from each.

The capture is labelled with the step its state is at. A rank may stand one step past its last
reported step (it finished its local optimizer step ``t + 1`` before the collective that broke):
:func:`state_step` reads that from the optimizer's own step count, and the recovery plan decides
what such a slice is good for (``layercheck.policies.plan``).

On a GPU the state is on the device. A survivor blocked in an NCCL collective gets control back
only once the collective is aborted (:mod:`layercheck.workers.collective_abort`); the work queued behind the
aborted kernel then runs, so the capture first waits (bounded) for the training stream to settle,
then copies into pinned host buffers on the side stream of :mod:`layercheck.workers.snapshot_copy`, waiting
for that copy bounded too. A failed NCCL collective hands back whatever the aborted kernel left
instead of raising, so there a state the optimizer updated after the last completed step may
hold such garbage: :func:`refusal` turns it down. A GPU whose state is lost (a sticky CUDA error)
raises in the first of these calls: the rank contributes nothing, as when it cannot capture in time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from layercheck.workers.host_buffers import HostBufferPool
from layercheck.workers.layer_state import optimizer_step_of
from layercheck.workers.layout import Piece, StateLayout, zero0_owned_range
from layercheck.workers.shard import LayerShard, ParamSlice
from layercheck.workers.snapshot_copy import HostCopier, SnapshotCopier, wait_done

#: The longest a capture waits for its device: the training stream to settle, then its own copy.
DEVICE_WAIT_S = 20.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class StepMark:
    """Where this rank's state stood after its last completed ``after_step``: the loop step and
    the optimizer's own step count then (they differ by a constant after a resume)."""

    step: int
    optimizer_step: int


def mark(layout: StateLayout, step: int) -> StepMark:
    """A :class:`StepMark` for ``step``, read after the step's optimizer update (cheap: a dict read)."""
    return StepMark(step=step, optimizer_step=_optimizer_step(layout))


def state_step(layout: StateLayout, last: StepMark) -> int:
    """The loop step this rank's optimizer state is at now: ``last.step``, or one more if the
    optimizer has stepped since (a failure after the local update, before the step was reported)."""
    return last.step + (_optimizer_step(layout) - last.optimizer_step)


def refusal(last: StepMark, step: int, *, synchronous_errors: bool) -> str:
    """Why a capture at ``step`` (:func:`state_step`) must not be handed over, or ``""``. Where a
    failed collective raises where it ran (gloo), an update after the last completed step used
    whole gradients: the capture is exact at ``step``. Where it does not (NCCL), that update may
    have consumed an aborted collective's output: only the state of the last completed step is sure."""
    if step == last.step or synchronous_errors:
        return ""
    return (
        f"the optimizer stepped past step {last.step} (to {step}) and a failed collective on this "
        "backend returns without raising: that update may hold an aborted collective's output"
    )


def _optimizer_step(layout: StateLayout) -> int:
    first = next(iter(layout.layer_map.names), None)
    return optimizer_step_of(layout, first) if first is not None else 0


def capture_pieces(layout: StateLayout) -> dict[str, tuple[Piece, ...]]:
    """For each layer, the pieces this rank captures (see the module docstring)."""
    if layout.stage != 0:  # what it needs is what it holds (ZeRO 1-3, FSDP2: what it owns; HSDP: its whole shard)
        return {name: layout[name].needed for name in layout.layer_map.names}
    first, last = max(0, layout.rank - 1), min(layout.world_size - 1, layout.rank + 1)
    out: dict[str, tuple[Piece, ...]] = {}
    for name in layout.layer_map.names:
        pieces: list[Piece] = []
        for whole in layout[name].needed:  # ZeRO-0: whole parameters
            s = whole.slice
            start = zero0_owned_range(s.length, first, layout.world_size)[0]
            end = sum(zero0_owned_range(s.length, last, layout.world_size))
            if end > start:
                pieces.append(Piece(ParamSlice(s.name, s.shape, start, end - start), whole.master, start))
        out[name] = tuple(pieces)
    return out


def capture_shards(
    layout: StateLayout,
    step: int,
    pool: HostBufferPool | None = None,
    *,
    copier: SnapshotCopier | None = None,
    timeout_s: float = DEVICE_WAIT_S,
) -> list[LayerShard]:
    """This rank's capture of every layer at ``step`` (its state's step, see :func:`state_step`),
    copied out of the optimizer into host buffers by ``copier`` (the rank's snapshot copier: on a
    GPU its side stream into pinned memory); raises ``TimeoutError`` if that copy has not landed
    within ``timeout_s``."""
    pieces = capture_pieces(layout)
    shards, done = (copier or HostCopier(layout)).copy(list(pieces), step, pool or HostBufferPool(), pieces=pieces)
    if not wait_done(done, timeout_s):
        raise TimeoutError(f"the capture's device-to-host copy did not land within {timeout_s:g}s")
    logger.info(
        "rank %d: captured %d layers at step %d (%d bytes)",
        layout.rank,
        len(shards),
        step,
        sum(s.nbytes for s in shards),
    )
    return shards


def captured_numel(pieces: Mapping[str, Sequence[Piece]]) -> int:
    return sum(p.slice.length for layer in pieces.values() for p in layer)
