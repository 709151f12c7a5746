"""Engine adapters: how one training engine's sharded state maps onto a
:class:`~layercheck.workers.layout.StateLayout`, the one seam the rest of LayerCheck reads.

DeepSpeed's adapter is still :mod:`layercheck.workers.layout` with :mod:`layercheck.workers.ds_internals`;
:mod:`layercheck.workers.engines.fsdp2` maps PyTorch FSDP2 (``fully_shard``), not yet reachable
from ``attach`` or the built-in loop (issue 54).
"""
