"""LayerCheck's Python API: layer-wise checkpointing and no-rollback recovery for your own
DeepSpeed training on Ray Train.

Driver::

    trainer = layercheck.LayerCheckTrainer(train_loop_per_worker, model=hf_config,
                                           checkpoint=layercheck.CheckpointConfig(storage="/shared/ckpt"),
                                           scaling_config=ScalingConfig(num_workers=2),
                                           run_config=RunConfig(failure_config=FailureConfig(max_failures=3)))
    result = trainer.fit()

Worker (inside ``train_loop_per_worker``, after ``deepspeed.initialize``)::

    lc = layercheck.attach(engine)
    for step in range(lc.start_step, total_steps + 1):
        ...; engine.step()
        lc.after_step(step, loss=loss)
    lc.finish()

Hugging Face ``Trainer`` / TRL ``SFTTrainer`` with DeepSpeed (in ``train_loop_per_worker``)::

    trainer.add_callback(layercheck.LayerCheckCallback(trainer))
    trainer.train()

Importing this package starts nothing; the heavier parts load on first use. The checkpoint
policies' configs are in :mod:`layercheck.policies` (``StaggeredConfig`` is the default).
"""

import importlib
import typing

if typing.TYPE_CHECKING:
    from layercheck import policies
    from layercheck.config import CheckpointConfig, FaultConfig, MetricsConfig, PersistenceConfig, WriteBudgetConfig
    from layercheck.hf import LayerCheckCallback, TrainerSetupError
    from layercheck.policies.layer_map import UnplacedParameterError
    from layercheck.trainer import FitResult, LayerCheckTrainer
    from layercheck.worker import Attachment, LayerMismatchError, attach
    from layercheck.workers.optim_state import UnsupportedOptimizerError

#: Each public name and the module it lives in, imported on first use.
_EXPORTS = {
    "attach": "layercheck.worker",
    "Attachment": "layercheck.worker",
    "LayerMismatchError": "layercheck.worker",
    "CheckpointConfig": "layercheck.config",
    "FaultConfig": "layercheck.config",
    "MetricsConfig": "layercheck.config",
    "PersistenceConfig": "layercheck.config",
    "WriteBudgetConfig": "layercheck.config",
    "LayerCheckTrainer": "layercheck.trainer",
    "FitResult": "layercheck.trainer",
    "LayerCheckCallback": "layercheck.hf",
    "TrainerSetupError": "layercheck.hf",
    "UnplacedParameterError": "layercheck.policies.layer_map",
    "UnsupportedOptimizerError": "layercheck.workers.optim_state",
}

__all__ = sorted([*_EXPORTS, "policies"])


def __getattr__(name: str) -> object:
    if name == "policies":
        return importlib.import_module("layercheck.policies")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'layercheck' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public API only (``dir(layercheck)``, ``help(layercheck)``), not this module's helpers."""
    return list(__all__)
