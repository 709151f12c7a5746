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

Importing this package starts nothing; the heavier parts load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from layercheck.config import CheckpointConfig, FaultConfig, MetricsConfig, PersistenceConfig, WriteBudgetConfig
    from layercheck.hf import LayerCheckCallback, TrainerSetupError
    from layercheck.policies.layer_map import UnplacedParameterError
    from layercheck.trainer import FitResult, LayerCheckTrainer
    from layercheck.worker import Attachment, LayerMismatchError, attach
    from layercheck.workers.optim_state import UnsupportedOptimizerError

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

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'layercheck' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
