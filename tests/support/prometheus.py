"""A real Prometheus server (Debian's ``prometheus`` package, which CI installs) for the tests:
the shipped scrape config and alert rules, pointed at a test's discovery directory."""

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from layercheck.workers.env import free_port
from tests.support.dashboards import DASHBOARDS

MISSING = (
    "the prometheus binary is not installed: install Debian's 'prometheus' package "
    "(apt-get install prometheus; .ci/run does it)"
)


class PrometheusUnavailable(RuntimeError):
    """No Prometheus could be started (not installed, exited, never ready); says why."""


class Prometheus:
    """A Prometheus server on a free loopback port, scraping what the shipped config finds in
    ``discovery_dir`` (the file_sd files a run's driver writes), its rules the shipped alerts."""

    def __init__(self, tmp: Path, discovery_dir: Path) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise PrometheusUnavailable(MISSING)
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
        self.at: float | None = None
        """Where set (the run's end, unix seconds), queries are evaluated at that moment, not at
        the time of asking: a test may read the run long after it ended (the suite runs on),
        when a ``[10m]`` window ending now would no longer reach it."""

    def _wait_ready(self, log: Path) -> None:
        for _ in range(600):
            if self.process.poll() is not None:
                raise PrometheusUnavailable(f"prometheus exited with {self.process.returncode}:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise PrometheusUnavailable(f"prometheus did not become ready:\n{log.read_text()}")

    def api(self, path: str, **params: str) -> dict:
        if path == "query" and self.at is not None:
            params.setdefault("time", f"{self.at:.3f}")
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
