"""The recovery package's own config: how long a recovery waits for the writers' drain, and how a
failed commit is retried (the supervision's :class:`SupervisionConfig`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SupervisionConfig:
    drain_deadline_s: float = 60.0
    """How long a recovery waits for the writers to hand over what they hold; a writer that has
    not answered by then is written off (its versions are counted lost) and recovery goes on."""
    commit_tries: int = 3
    """How often a whole version's commit is tried before the version is counted lost."""
    commit_backoff_s: float = 0.5
    """The wait before the first retry of a failed commit; doubled before each further one."""

    def __post_init__(self) -> None:
        if not self.drain_deadline_s > 0:
            raise ValueError(f"drain_deadline_s must be > 0, got {self.drain_deadline_s}")
        if self.commit_tries < 1:
            raise ValueError(f"commit_tries must be >= 1, got {self.commit_tries}")
        if self.commit_backoff_s < 0:
            raise ValueError(f"commit_backoff_s must be >= 0, got {self.commit_backoff_s}")

    def backoff_s(self, tries_done: int) -> float:
        """The wait before try ``tries_done + 1``."""
        return self.commit_backoff_s * 2 ** (tries_done - 1)
