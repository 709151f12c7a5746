"""A real Prometheus server (Debian's ``prometheus`` package, which CI installs) scrapes a short
demo run with one worker failure; its query API then shows the run's series with plausible
values, every dashboard query evaluates, and the alert rules load."""

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import ray
import yaml

from layercheck.orchestrator.core.run_config import load_run_config
from layercheck.orchestrator.runtime.cluster import connect
from layercheck.orchestrator.runtime.driver import train
from layercheck.orchestrator.runtime.metric_specs import BYTES_PER_PARAM
from layercheck.workers.env import free_port
from layercheck.workers.loop import DECISION_LAG
from tests.support.dashboards import DASHBOARDS, dashboard, dashboard_exprs, substitute

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
SMAX = 4


class Prometheus:
    def __init__(self, tmp: Path, discovery_dir: Path) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail(
                "the prometheus binary is not installed: install Debian's 'prometheus' package "
                "(apt-get install prometheus; .ci/run does it)"
            )
        self.url = f"http://127.0.0.1:{free_port()}"
        # the shipped config, finding the run the cluster way (the file_sd file its driver writes),
        # pointed at this test's discovery directory
        config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
        config["rule_files"] = [str(DASHBOARDS / "alerts.yml")]
        (job,) = config["scrape_configs"]
        # the directory exists, as after a user's first run, so Prometheus watches it and finds
        # the run at once (a directory created later is found by the 5 s refresh_interval only,
        # too late for most of this short run on a loaded machine)
        discovery_dir.mkdir(parents=True, exist_ok=True)
        (sd,) = job["file_sd_configs"]
        sd["files"] = [str(discovery_dir / "*.json")]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(tmp / "prometheus.log", "w")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self._wait_ready(tmp / "prometheus.log")

    def _wait_ready(self, log: Path) -> None:
        for _ in range(600):
            if self.process.poll() is not None:
                pytest.fail(f"prometheus exited with {self.process.returncode}:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        pytest.fail(f"prometheus did not become ready:\n{log.read_text()}")

    def api(self, path: str, **params: str) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                return json.load(response)
        except urllib.error.HTTPError as error:
            return json.load(error)

    def query(self, expr: str) -> list[dict]:
        body = self.api("query", query=expr)
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def scalar(self, expr: str) -> float:
        (sample,) = self.query(expr)
        return float(sample["value"][1])

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """One short demo run with a failure, scraped every second by a real Prometheus."""
    tmp = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    prometheus = Prometheus(tmp, tmp / "sd")
    config = load_run_config(
        ROOT / "examples" / "demo.toml",
        {
            "name": "metrics",
            "storage": str(tmp / "store"),
            "steps": 15,
            "optim.total_steps": 15,
            "optim.warmup_steps": 2,
            # the paper's policy: its base at step 3 and drift thresholds exercise every metric
            "policy": {"name": "layercheck", "warmup_steps": 3, "smax": SMAX, "k0": 0.05, "k0_embed": 0.05},
            "fault.kill_at_step": 8,
            "metrics.port": port,
            "metrics.host": "auto",  # one node: 127.0.0.1
            "metrics.discovery_dir": str(tmp / "sd"),
        },
    )
    connect(config)
    try:
        result = train(config)  # waits until Prometheus has scraped the final values
        assert not list((tmp / "sd").glob("*.json"))  # the run's discovery file went with it
        yield prometheus, result, tmp
    finally:
        ray.shutdown()
        prometheus.stop()


def test_the_run_summary_names_its_endpoint(scraped):
    _, result, _ = scraped
    assert result.error is None, result.error
    port = result.config.metrics.port
    assert result.metrics_url == f"http://127.0.0.1:{port}/metrics"
    from layercheck.orchestrator.runtime.summary import format_summary, summarize

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
    assert last("layercheck_step_duration_seconds_count") >= 15  # lost steps were trained twice
    assert last("layercheck_training_step") == 15
    assert prometheus.scalar(f'last_over_time(layercheck_supervisor_state{{{run}, state="finished"}}[10m])') == 1


def test_counters_survive_the_worker_group_restart(scraped):
    prometheus, result, _ = scraped
    run = f'run_id="{result.run_id}"'
    assert prometheus.scalar(f"last_over_time(layercheck_failures_total{{{run}}}[10m])") == 1
    assert prometheus.scalar(f"max_over_time(layercheck_worker_group_attempt{{{run}}}[10m])") == 2
    assert prometheus.scalar(f"last_over_time(layercheck_recoveries_total{{{run}}}[10m])") == 1
    assert prometheus.scalar(f"last_over_time(layercheck_steps_lost_total{{{run}}}[10m])") == 0
    (phases,) = [prometheus.query(f"last_over_time(layercheck_recovery_seconds_count{{{run}}}[10m])")]
    assert {s["metric"]["phase"] for s in phases} == {"detect", "plan", "load", "total"}
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
