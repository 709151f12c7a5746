"""Which versions are whole: collects each rank's shard receipt and says when all are in.

A version of a layer is committed only once every rank's shard of it is written. When a newer
version of the layer commits first (an older shard was superseded on some rank, or a write
failed), the older incomplete version is abandoned: its files become orphans for GC.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from layercheck.orchestrator.store.manifest import ShardReceipt

logger = logging.getLogger(__name__)

VersionKey = tuple[str, int, bool, str]  # layer, step, base, origin


@dataclass
class CommitTracker:
    _receipts: dict[VersionKey, dict[int, ShardReceipt]] = field(default_factory=dict)
    _committed_step: dict[str, int] = field(default_factory=dict)
    abandoned: int = 0

    def add(self, receipt: ShardReceipt) -> list[ShardReceipt] | None:
        """Record one rank's receipt; the whole version's receipts once the last rank is in."""
        if receipt.step <= self._committed_step.get(receipt.layer, -1):
            logger.info(
                "dropping %s step %d rank %d: a newer version is committed", receipt.layer, receipt.step, receipt.rank
            )
            return None
        key = (receipt.layer, receipt.step, receipt.base, receipt.origin)
        ranks = self._receipts.setdefault(key, {})
        ranks[receipt.rank] = receipt
        if len(ranks) < receipt.world_size:
            return None
        del self._receipts[key]
        return [ranks[r] for r in sorted(ranks)]

    def committed(self, layer: str, step: int) -> None:
        """A version of ``layer`` at ``step`` is in the manifest: older partial ones never will be."""
        self._committed_step[layer] = max(step, self._committed_step.get(layer, -1))
        for key in [k for k in self._receipts if k[0] == layer and k[1] < step]:
            del self._receipts[key]
            self.abandoned += 1
            logger.info("abandoned incomplete version of %s at step %d", key[0], key[1])

    def forget(self, layer: str, step: int) -> bool:
        """A shard of ``layer`` at ``step`` was lost (with its writer): drop what came of that
        version; True if any rank's receipt was held."""
        keys = [k for k in self._receipts if k[0] == layer and k[1] == step]
        for key in keys:
            del self._receipts[key]
        return bool(keys)

    def forget_incomplete(self) -> int:
        """A worker group was lost: its half-written versions will never complete."""
        lost = len(self._receipts)
        self.take_incomplete(upto=None)
        return lost

    def take_incomplete(self, *, upto: int | None) -> list[list[ShardReceipt]]:
        """A worker group was lost: its half-written versions will never complete. Returns, per
        version at or before step ``upto`` (``None``: none), the receipts that did come in — what
        the surviving ranks wrote, committable as a partial version; the others are abandoned."""
        kept = [
            [ranks[r] for r in sorted(ranks)]
            for key, ranks in self._receipts.items()
            if upto is not None and key[1] <= upto
        ]
        self.abandoned += len(self._receipts)  # as whole versions, kept ones too
        self._receipts.clear()
        return kept

    @property
    def incomplete(self) -> int:
        return len(self._receipts)
