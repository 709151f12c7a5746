"""A run's status (``RunStatus``) for tests of what reads one: every field at a quiet run's value,
the ones a test cares about given."""

from layercheck.orchestrator.core.run_status import RunStatus


def a_status(**fields) -> RunStatus:
    account = {"recoveries": [], "failures": 0, "ettr": 1.0, **fields.pop("account", {})}
    base = dict(
        run_id="r1",
        metrics_url=None,
        state="running",
        attempt=1,
        step=0,
        loss=float("nan"),
        lr=0.0,
        step_s=0.0,
        staleness={},
        max_staleness=None,
        weighted_staleness=None,
        layers={},
        bytes_committed=0,
        versions_committed=0,
        partial_bytes_committed=0,
        partial_versions_committed=0,
        abandoned_versions=0,
        lost_versions=0,
        lost=[],
        commit_retries=0,
        write_failures=0,
        writers_replaced=0,
        staleness_breach=None,
        staleness_lag=None,
        stop_reason=None,
        write_latencies=[],
        account=account,
        world_size=0,
        grown_from=0,
        memory_period=None,
    )
    return RunStatus(**{**base, **fields})
