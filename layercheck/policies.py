"""The checkpoint policies a :class:`layercheck.CheckpointConfig` can name (typed configs).

``LayerCheckConfig`` is the paper's drift-threshold policy, ``DriftOptimalConfig`` equal
per-layer periods chosen from the drift, ``IntervalConfig`` full checkpoints every N steps
(``interval=1``: every layer every step), ``NeverConfig`` no checkpoints.
"""

from policies.configs import DriftOptimalConfig, IntervalConfig, LayerCheckConfig, NeverConfig, PolicyConfig

__all__ = ["DriftOptimalConfig", "IntervalConfig", "LayerCheckConfig", "NeverConfig", "PolicyConfig"]
