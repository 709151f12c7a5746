"""Engine adapters: the training engines LayerCheck speaks, behind one protocol
(:class:`~layercheck.workers.engines.base.TrainingEngine`).

- :mod:`~layercheck.workers.engines.deepspeed`: DeepSpeed ZeRO 0-3 (its private attributes read only
  through :mod:`~layercheck.workers.engines.ds_internals`);
- :mod:`~layercheck.workers.engines.fsdp2`: PyTorch FSDP2 (``fully_shard`` over a 1-D mesh).

Only these modules import DeepSpeed or FSDP (``tests/repo/test_layering.py``). This package's own
module imports nothing: the driver reads :data:`WORKER_ENV` without torch.
"""

#: Set to ``1`` to run on a DeepSpeed outside the releases :mod:`.ds_internals` was verified against
#: (an error is logged instead of raised): for verifying a new release with
#: ``tests/workers/test_worker_ds_internals.py``.
ALLOW_UNVERIFIED_ENV = "LAYERCHECK_ALLOW_UNVERIFIED_DEEPSPEED"
#: The engines' environment switches a job's workers inherit from the driver's environment.
WORKER_ENV: tuple[str, ...] = (ALLOW_UNVERIFIED_ENV,)
