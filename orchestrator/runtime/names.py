"""The names of a run's Ray actors, so the driver creates and the workers find the same ones."""

from __future__ import annotations

from dataclasses import dataclass

NAMESPACE = "layercheck"


@dataclass(frozen=True)
class RunNames:
    run_id: str

    @property
    def supervisor(self) -> str:
        return f"{self.run_id}/supervisor"

    @property
    def policy(self) -> str:
        return f"{self.run_id}/policy"
