"""Ray Train's base class for a run's user callbacks, as the installed Ray has it: the callbacks
LayerCheck adds to a run (``train_report.ReportsToSupervisor``, ``setup_errors.SetupErrorsEndTheRun``)
derive from it."""

from __future__ import annotations


def user_callback_base() -> type:
    """Ray Train's ``UserCallback`` (Train v2), else ``object``."""
    try:
        from ray.train import UserCallback

        return UserCallback
    except ImportError:  # Train v1 (RAY_TRAIN_V2_ENABLED=0): never instantiated there
        return object
