"""Pure decision logic: the layer map, checkpoint policies and the recovery plan.

Nothing here imports Ray, torch.distributed, DeepSpeed or pyarrow, or touches storage: every
function is a value in, value out, so the decisions can be unit-tested and replayed.

The checkpoint policies a :class:`layercheck.CheckpointConfig` can name, as typed configs:
``StaggeredConfig`` (the default) equal per-layer periods with phases spread over the steps
under a byte budget, ``LayerCheckConfig`` the paper's drift-threshold policy,
``DriftOptimalConfig`` equal per-layer periods chosen from the drift, ``IntervalConfig`` full
checkpoints every N steps (``interval=1``: every layer every step), ``NeverConfig`` none.
"""

from layercheck.policies.configs import (
    DriftOptimalConfig,
    IntervalConfig,
    LayerCheckConfig,
    NeverConfig,
    PolicyConfig,
    StaggeredConfig,
)

__all__ = ["DriftOptimalConfig", "IntervalConfig", "LayerCheckConfig", "NeverConfig", "PolicyConfig", "StaggeredConfig"]
