"""The ``TorchTrainer`` LayerCheck runs: Ray Train's, less what a run without Ray datasets never uses.

Ray Train 2.60 starts a ``DatasetManager`` actor at every worker-group start (the run's start and
each full restart), datasets or not (``DatasetsCallback``): one more Ray process, about 2 s of CPU,
competing with the new workers' imports and engine builds. LayerCheck's built-in loop reads its
own data and passes Ray Train no datasets; a ``LayerCheckTrainer`` user may pass some, and then
keeps it. Measured on the demo with a failure (2 CPU cores, 2 runs each way, alternating): 32.6 s
wall and 56.0 s of CPU with it, 29.6 s and 52.5 s without.
"""

from __future__ import annotations

from typing import Any

from ray.train.torch import TorchTrainer


class LayerCheckTorchTrainer(TorchTrainer):
    """Ray Train's ``TorchTrainer``; with no ``datasets``, without Ray Data's callback (above)."""

    def _create_default_callbacks(self) -> list[Any]:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

        # Train v2's (ray.train.torch's when RAY_TRAIN_V2_ENABLED); mypy sees v1's, which has none
        callbacks = super()._create_default_callbacks()  # type: ignore[misc]
        if self.datasets:
            return list(callbacks)
        return [callback for callback in callbacks if not isinstance(callback, DatasetsCallback)]
