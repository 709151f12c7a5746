"""The devices a test runs on: always ``cpu``; ``cuda`` too when ``LAYERCHECK_TEST_DEVICE=cuda``
(``scripts/gpu_checks.sh`` sets it). Without the switch a ``cuda`` case is skipped, never passed;
with it and no GPU, the case fails: a GPU check that cannot run must not look green."""

from __future__ import annotations

import os

import pytest
import torch

ENV = "LAYERCHECK_TEST_DEVICE"


def cuda_requested() -> bool:
    return os.environ.get(ENV, "cpu") == "cuda"


def devices() -> list:
    """``pytest.mark.parametrize("device", devices())``."""
    skip = pytest.mark.skipif(not cuda_requested(), reason=f"CUDA case: set {ENV}=cuda on a GPU machine")
    return ["cpu", pytest.param("cuda", marks=skip)]


def require(device: str) -> torch.device:
    """The torch device for a case; a requested CUDA that is missing fails the test."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.fail(f"{ENV}=cuda but torch.cuda.is_available() is False")
    return torch.device(device)
