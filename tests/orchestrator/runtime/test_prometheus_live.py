"""A real Prometheus server (Debian's ``prometheus`` package, which CI installs) scrapes a short
demo run with one worker failure (tests/support/ray_runs.py, ``layercheck_run``); its query API
then shows the run's series with plausible values, every dashboard query evaluates, and the
alert rules load."""

import subprocess
import sys

import pytest
import yaml

from layercheck.orchestrator.runtime.metric_specs import BYTES_PER_PARAM, RECOVERY_PHASES
from layercheck.workers.loop import DECISION_LAG
from tests.support.dashboards import DASHBOARDS, dashboard, dashboard_exprs, substitute
from tests.support.ray_runs import LAYERCHECK, STEPS

pytestmark = pytest.mark.slow
SMAX = LAYERCHECK.smax


@pytest.fixture(scope="module")
def scraped(layercheck_run):
    """The demo under the layercheck policy with a failure, scraped every second by a real
    Prometheus (the ``layercheck_run`` session fixture, which the end-to-end tests read too)."""
    result, prometheus, missing, tmp = layercheck_run
    if prometheus is None:
        pytest.fail(missing)
    assert not list((tmp / "sd").glob("*.json"))  # the run's discovery file went with it
    return prometheus, result, tmp


def test_the_run_summary_names_its_endpoint(scraped):
    _, result, _ = scraped
    assert result.error is None, result.error
    port = result.config.metrics.port
    assert result.metrics_url == f"http://127.0.0.1:{port}/metrics"
    from layercheck.orchestrator.runtime.run_summary import format_summary, summarize

    assert result.metrics_url in format_summary(summarize(result))


def test_prometheus_holds_the_runs_staleness_bytes_and_ettr(scraped):
    prometheus, result, _ = scraped
    run = f'run_id="{result.run_id}"'
    last = lambda name: prometheus.scalar(f"last_over_time({name}{{{run}}}[10m])")  # noqa: E731

    layers = prometheus.query(f"last_over_time(layercheck_layer_staleness_steps{{{run}}}[10m])")
    assert {s["metric"]["layer"] for s in layers} == set(result.layer_numel)
    assert all(s["metric"]["job"] == "layercheck" for s in layers)
    assert last("layercheck_smax_steps") == SMAX
    # a decision is carried out one step later (DECISION_LAG); once the writers are drained (at
    # the end, and in the composite a recovery loads) no committed version is older than that.
    # While the run goes on, staleness also counts steps a version spends being written.
    assert 0 <= last("layercheck_staleness_max_steps") <= SMAX + DECISION_LAG
    assert last("layercheck_staleness_max_steps") == result.status["max_staleness"]
    composite = prometheus.scalar(
        f'last_over_time(layercheck_recovery_composite_staleness_steps{{{run}, aggregation="max"}}[10m])'
    )
    assert 0 <= composite <= SMAX + DECISION_LAG
    max_staleness = prometheus.scalar(f"max_over_time(layercheck_staleness_max_steps{{{run}}}[10m])")
    weighted = prometheus.scalar(f"max_over_time(layercheck_staleness_weighted_steps{{{run}}}[10m])")
    assert 0 <= weighted <= max_staleness <= last("layercheck_training_step")

    full = sum(result.layer_numel.values()) * BYTES_PER_PARAM
    assert last("layercheck_full_checkpoint_bytes") == full
    committed = last("layercheck_committed_bytes_total")
    assert committed == result.status["bytes_committed"] > full  # the base, then layer versions
    assert last("layercheck_written_bytes_total") >= committed
    assert last("layercheck_full_checkpoint_equivalent_bytes") > 0
    assert 0 < last("layercheck_ettr_ratio") <= 1
    assert 0 <= last("layercheck_ettr_recent_ratio") <= 1
    assert last("layercheck_step_duration_seconds_count") >= STEPS  # lost steps were trained twice
    assert last("layercheck_training_step") == STEPS
    assert prometheus.scalar(f'last_over_time(layercheck_supervisor_state{{{run}, state="finished"}}[10m])') == 1


def test_counters_survive_the_worker_group_restart(scraped):
    prometheus, result, _ = scraped
    run = f'run_id="{result.run_id}"'
    assert prometheus.scalar(f"last_over_time(layercheck_failures_total{{{run}}}[10m])") == 1
    assert prometheus.scalar(f"max_over_time(layercheck_worker_group_attempt{{{run}}}[10m])") == 2
    assert prometheus.scalar(f"last_over_time(layercheck_recoveries_total{{{run}}}[10m])") == 1
    assert prometheus.scalar(f"last_over_time(layercheck_steps_lost_total{{{run}}}[10m])") == 0
    (phases,) = [prometheus.query(f"last_over_time(layercheck_recovery_seconds_count{{{run}}}[10m])")]
    assert {s["metric"]["phase"] for s in phases} == set(RECOVERY_PHASES)
    for counter in (
        "layercheck_written_bytes_total",
        "layercheck_committed_bytes_total",
        "layercheck_layer_committed_versions_total",
        "layercheck_step_duration_seconds_count",
    ):
        for sample in prometheus.query(f"resets({counter}{{{run}}}[10m])"):
            assert float(sample["value"][1]) == 0, (counter, sample["metric"])
    # one exporter served the run before and after the restart: one series went from 0 to 1 failure
    (failures,) = prometheus.api("query", query=f"layercheck_failures_total{{{run}}}[10m]")["data"]["result"]
    assert {float(v) for _, v in failures["values"]} == {0.0, 1.0}


def test_every_dashboard_query_evaluates_on_the_server(scraped):
    prometheus, result, _ = scraped
    for expr in dashboard_exprs(dashboard()):
        body = prometheus.api("query", query=substitute(expr).replace("demo-0", result.run_id))
        assert body["status"] == "success", (expr, body)


def test_the_alert_rules_load_and_evaluate(scraped):
    prometheus, _, _ = scraped
    groups = prometheus.api("rules")["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == len(yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())["groups"][0]["rules"])
    assert all(rule["health"] == "ok" for rule in rules), rules


def test_the_plot_script_renders_the_run(scraped):
    prometheus, result, tmp = scraped
    out = tmp / "run.png"
    subprocess.run(
        [
            sys.executable,
            str(DASHBOARDS / "plot_run.py"),
            "--prometheus",
            prometheus.url,
            "--run-id",
            result.run_id,
            "--out",
            str(out),
        ],
        check=True,
        timeout=120,
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
