"""A clock a test moves by hand: ``clock.now += 1.5``; called, it says ``now``."""


class ManualClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
