"""The ``TorchTrainer`` LayerCheck runs: Ray Train's, less what a run without Ray datasets never uses.

Ray Train 2.60 starts a ``DatasetManager`` actor at every worker-group start (the run's start and
each full restart), datasets or not (``DatasetsCallback``): one more Ray process, about 2 s of CPU,
competing with the new workers' imports and engine builds. LayerCheck's built-in loop reads its
own data and passes Ray Train no datasets; a ``LayerCheckTrainer`` user may pass some, and then
keeps it. Measured on the demo with a failure (2 CPU cores, 2 runs each way, alternating): 32.6 s
wall and 56.0 s of CPU with it, 29.6 s and 52.5 s without.

Its ``PlacementGroupCleaner`` (a detached actor that removes the placement group of a controller
that died without doing so) asks Ray's State API every second whether the controller lives. The
local Ray LayerCheck starts has no dashboard, so no State API: the cleaner could never tell, and
logged a warning every second of the run. That Ray, and every placement group in it, ends with
the driver, so there is nothing for the cleaner to do: it is left out there too.
"""

from __future__ import annotations

from typing import Any

from ray.train.torch import TorchTrainer

from layercheck.orchestrator.runtime.cluster import has_state_api


class LayerCheckTorchTrainer(TorchTrainer):
    """Ray Train's ``TorchTrainer``; with no ``datasets``, without Ray Data's callback, and
    without the placement-group cleaner where Ray has no State API (above)."""

    def _create_default_callbacks(self) -> list[Any]:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

        # Train v2's (ray.train.torch's when RAY_TRAIN_V2_ENABLED); mypy sees v1's, which has none
        callbacks = list(super()._create_default_callbacks())  # type: ignore[misc]
        unused: list[type] = [] if self.datasets else [DatasetsCallback]
        if not has_state_api():
            unused.append(PlacementGroupCleanerCallback)
        return [callback for callback in callbacks if not isinstance(callback, tuple(unused))]
