"""The dashboard and alert rules in dashboards/ as the tests read them: the files, their PromQL
expressions, and the Grafana variables substituted as Grafana does before it sends a query."""

import json
import re
from pathlib import Path

import yaml

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
DASHBOARD = DASHBOARDS / "layercheck-dashboard.json"
ALERTS = DASHBOARDS / "alerts.yml"
METRIC = re.compile(r"\blayercheck_[a-z0-9_]+")
#: What Grafana substitutes into a query before sending it, for checking it outside Grafana.
GRAFANA_VARIABLES = {"$run_id": "demo-0", "$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> list[dict]:
    out = []
    for panel in board["panels"]:
        out += [panel, *panel.get("panels", [])]
    return out


def dashboard_exprs(board: dict) -> list[str]:
    exprs = [t["expr"] for p in panels(board) for t in p.get("targets", [])]
    exprs += [a["expr"] for a in board["annotations"]["list"] if "expr" in a]
    return exprs


def alert_exprs() -> list[str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def substitute(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return expr
