"""The LayerCheck part of a user's own training run: where checkpoints go and how they are chosen."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from layercheck.orchestrator.core.persistence.config import PersistenceConfig
from layercheck.orchestrator.core.persistence.write_budget import WriteBudgetConfig
from layercheck.orchestrator.core.run_config import FaultConfig, MetricsConfig
from layercheck.policies.config_loader import ConfigError, require
from layercheck.policies.configs import DEFAULT_POLICY, POLICY_CONFIGS, PolicyConfig, policy_config
from layercheck.policies.layer_map import LayerMapSpec
from layercheck.workers.drift.diff import PROBES

__all__ = ["CheckpointConfig", "FaultConfig", "MetricsConfig", "PersistenceConfig", "WriteBudgetConfig"]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """LayerCheck's settings for a :class:`layercheck.LayerCheckTrainer` run."""

    storage: str
    """Store URI: a path (made absolute on the driver), ``file://``, ``s3://``, ``gs://``."""
    name: str = "layercheck"
    """The run's name: the actors and the Ray Train run are named after it."""
    policy: PolicyConfig | str = DEFAULT_POLICY
    """The checkpoint policy: a config from :mod:`layercheck.policies`, or the name of one with its
    defaults (``staggered``, the default, as in ``layercheck train``; ``layercheck``, the paper's
    thresholds; ``drift-optimal``, ``interval``, ``never``)."""
    persistence: PersistenceConfig = field(default_factory=PersistenceConfig)
    """The asynchronous writers (per node, bytes in flight, fsync, the write budget)."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """The Prometheus endpoint (``port=0`` disables it)."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """The recovery rehearsal (a demo's): SIGKILL ``kill_rank`` after ``kill_at_step`` (0: never)."""
    drift_probe: str = "auto"
    """``auto`` (the optimizer probe where LayerCheck built the optimizer; for your torch
    ``AdamW``/``Adam`` on CPU, the fused step in its place, bit-equal to it; else snapshot-and-diff),
    ``optimizer``, ``fused`` (the drift counted inside the update: DriftAdamW's fused step, a
    Triton kernel on CUDA, or the fused step in place of your AdamW), ``step_hooks`` (a copy before
    your optimizer's step and the diff after; no reference copy held) or ``snapshot_diff``."""
    layer_map: LayerMapSpec | None = None
    """How parameters group into layers when the names do not say: ``{"layer": ["param.prefix", ...]}``
    or a function ``param_name -> layer name``; ``None``: from the names (Llama, GPT-2, ... families)."""
    shared_storage: bool = False
    """``storage`` is a path on a filesystem every node mounts (NFS, Lustre, a bucket mount). On a
    Ray cluster of more than one node a plain path is refused without it; ``s3://``/``gs://`` need no opt-in."""
    overwrite: bool = False
    """Delete checkpoints an earlier run left in ``storage`` (else such a store is refused)."""
    tokenizer: str | None = None
    """Where the run's tokenizer comes from (a local directory or a Hugging Face name), kept in the
    store so that ``layercheck export --format hf`` ships it beside the model; ``None``: with the
    Hugging Face callback, the ``Trainer``'s own (its ``processing_class``), its files kept in the
    store; else the export has none, and says so."""
    in_place: bool = False
    """Recover from a lost worker in place: Ray Train replaces only that worker; each survivor
    captures its slices, leaves the broken process group and runs ``train_loop_per_worker`` again
    in its own process (``attach`` then loads the composite and says ``start_step = t_fail + 1``),
    so it keeps its imports and its process (on a GPU its CUDA context). Needs a fixed group (an
    ``int`` ``num_workers``) and the trainer's own ``torch_config``; a failure on this path falls
    back to Ray Train's full restart."""
    spares: int = 0
    """``in_place``: warm spares, workers beyond the ``ScalingConfig``'s ``num_workers`` (each holds a
    worker's resources, idle: a GPU each with ``use_gpu``). A spare runs ``train_loop_per_worker`` as
    far as it goes before it needs its rank (``ray.train.get_context().get_world_rank()``) or its
    process group (``deepspeed.initialize``, the ``Trainer``'s arguments, ``torch.distributed``), and
    waits there; when a worker is lost it goes on at once as the lost rank, while Ray Train starts
    the replacement, which becomes the next spare."""
    regroup_timeout_s: float = 600.0
    """``in_place``: how long the ranks wait for each other (a replacement's start included) to
    form the process group again; past it they raise (a failed recovery in place: every rank is
    then replaced, as under a full restart)."""

    def __post_init__(self) -> None:
        require(bool(_NAME.match(self.name)), "name", "letters, digits, '_', '.', '-'", self.name)
        require(bool(self.storage), "storage", "a path or URI", self.storage)
        require(self.drift_probe in PROBES, "drift_probe", f"one of {PROBES}", self.drift_probe)
        require(self.regroup_timeout_s > 0, "regroup_timeout_s", "> 0", self.regroup_timeout_s)
        require(self.spares >= 0, "spares", ">= 0", self.spares)
        require(
            not self.spares or self.in_place,
            "spares",
            "0 unless in_place=True (a spare takes a lost rank's place in the survivors' group)",
            self.spares,
        )
        if isinstance(self.policy, str):
            if self.policy not in POLICY_CONFIGS:
                raise ConfigError(
                    f"policy: must be one of {', '.join(POLICY_CONFIGS)} or a policy config, got {self.policy!r}"
                )
            object.__setattr__(self, "policy", policy_config(self.policy))
        if self.layer_map is not None and not (callable(self.layer_map) or isinstance(self.layer_map, dict)):
            raise ConfigError(
                "layer_map: a dict of layer name -> parameter-name prefixes, or a function "
                f"param_name -> layer name; got {type(self.layer_map).__name__}"
            )

    @property
    def storage_uri(self) -> str:
        """``storage`` with a relative path made absolute (Ray workers run elsewhere)."""
        uri = self.storage.replace("{name}", self.name)
        return uri if "://" in uri or os.path.isabs(uri) else os.path.abspath(uri)

    def replace(self, **changes: Any) -> CheckpointConfig:
        return dataclasses.replace(self, **changes)
