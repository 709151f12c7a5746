"""The dashboard, scrape config and alert rules in dashboards/ against the code: every metric a
panel or a rule references is one layercheck.orchestrator.runtime.metric_specs declares, and every PromQL expression
parses (promtool, from Debian's ``prometheus`` package, which CI installs)."""

import shutil
import subprocess

import pytest
import yaml

from layercheck.orchestrator.runtime.metric_specs import series_names
from tests.support.dashboards import (
    ALERTS,
    DASHBOARDS,
    METRIC,
    alert_exprs,
    dashboard,
    dashboard_exprs,
    panels,
    substitute,
)


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool not found: install Debian's 'prometheus' package (apt-get install prometheus; .ci/run does it)"
        )
    return path


def test_every_referenced_metric_is_exported():
    board = dashboard()
    variables = [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"]
    for expr in dashboard_exprs(board) + alert_exprs() + variables:
        unknown = set(METRIC.findall(expr)) - series_names()
        assert not unknown, f"{expr!r} references metrics the code does not export: {sorted(unknown)}"


def test_the_dashboard_is_importable_and_selects_one_run():
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"  # import asks for nothing, the variable picks
    assert "run_id" in variables and "layercheck_" in variables["run_id"]["definition"]
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids))
    graphs = [p for p in panels(board) if p["type"] != "row"]
    for panel in graphs:
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert 'run_id="$run_id"' in target["expr"], (panel["title"], target["expr"])
    kinds = {p["type"] for p in graphs}
    assert "heatmap" in kinds
    referenced = {m for p in graphs for t in p["targets"] for m in METRIC.findall(t["expr"])}
    for needed in (
        "layercheck_layer_staleness_steps",
        "layercheck_staleness_max_steps",
        "layercheck_staleness_weighted_steps",
        "layercheck_smax_steps",
        "layercheck_committed_bytes_total",
        "layercheck_full_checkpoint_equivalent_bytes",
        "layercheck_persistence_queue_versions",
        "layercheck_stall_seconds_total",
        "layercheck_ettr_ratio",
        "layercheck_failures_total",
        "layercheck_recovery_seconds_sum",
    ):
        assert needed in referenced, needed


def test_every_dashboard_expression_parses(tmp_path):
    """promtool parses a rule file's expressions: the dashboard's queries go in as recording rules."""
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"layercheck_dashboard:query{i}", "expr": substitute(expr)}
                    for i, expr in enumerate(dashboard_exprs(dashboard()))
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    done = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_alert_rules_and_scrape_config_pass_promtool():
    for args in (
        ["check", "rules", str(ALERTS)],
        ["test", "rules", str(DASHBOARDS / "alerts_test.yml")],
        ["check", "config", str(DASHBOARDS / "prometheus.yml")],
    ):
        done = subprocess.run([promtool(), *args], capture_output=True, text=True, cwd=DASHBOARDS)
        assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"


def test_the_scrape_config_finds_runs_through_their_discovery_files():
    """Local or on a cluster, a run is found the same way: the file_sd file its driver writes."""
    import fnmatch

    from layercheck.orchestrator.core.run_config import load_run_config
    from layercheck.orchestrator.runtime.metrics_discovery import discovery_entry, discovery_path

    demo = load_run_config(DASHBOARDS.parent / "examples" / "demo.toml").metrics
    config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    patterns = [f for sd in job["file_sd_configs"] for f in sd["files"]]
    assert any(fnmatch.fnmatch(discovery_path(demo.discovery_dir, "demo-1234abcd"), p) for p in patterns)
    assert discovery_entry(f"http://127.0.0.1:{demo.port}/metrics") == [
        {"targets": [f"127.0.0.1:{demo.port}"], "labels": {}}
    ]
    assert config["rule_files"] == ["alerts.yml"]
