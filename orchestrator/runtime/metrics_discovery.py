"""How Prometheus finds a run's exporter on a cluster: a ``file_sd`` discovery file.

The exporter lives in the run's supervisor actor, which Ray may place on any node. The driver
(on the head node under ``ray job submit``, where Prometheus usually runs beside Ray's own
``/tmp/ray/prom_metrics_service_discovery.json``) writes ``<discovery_dir>/<run_id>.json`` with
the endpoint's ``host:port`` while the run is live and removes it at the end;
``dashboards/prometheus.yml`` watches that directory. Ray's own metrics pipeline
(``ray.util.metrics``) was the other way: it renames every metric ``ray_<name>`` (Ray's metrics
agent namespaces them) and exports at Ray's report interval, so the dashboard, the alerts and
users' queries would all change; see docs/observability.md, "Metrics on a cluster".

Binding: ``metrics.host = "auto"`` serves on 127.0.0.1 on a one-node cluster (nothing else can
reach it) and on the supervisor's node IP on a multi-node one (Prometheus on another node must).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

#: ``metrics.host`` values resolved at run time (any other value is an address to bind).
AUTO_HOST = "auto"
NODE_HOST = "node"


def bind_host(host: str, *, alive_nodes: int) -> str:
    """The address (or ``node``: the supervisor's node IP) the exporter binds for ``metrics.host``."""
    if host != AUTO_HOST:
        return host
    return NODE_HOST if alive_nodes > 1 else "127.0.0.1"


def discovery_entry(url: str) -> list[dict[str, object]]:
    """The ``file_sd`` content naming the exporter at ``url`` (``http://HOST:PORT/metrics``). No
    extra labels: the metrics carry their run's labels, and a target label of the same name
    would be renamed ``exported_*`` by Prometheus."""
    return [{"targets": [urlsplit(url).netloc], "labels": {}}]


def discovery_path(directory: str, run_id: str) -> str:
    return os.path.join(directory, f"{run_id}.json")


def write_discovery(directory: str, run_id: str, url: str) -> str | None:
    """Write the run's discovery file atomically (Prometheus must never read half a file); its
    path, or ``None`` (logged) if it cannot be written: the run trains on, unscraped."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{run_id}.", suffix=".tmp")
        with os.fdopen(fd, "w") as file:
            json.dump(discovery_entry(url), file)
        path = discovery_path(directory, run_id)
        os.replace(tmp, path)
    except OSError as error:
        logger.error("cannot write the Prometheus discovery file in %s: %s", directory, error)
        return None
    logger.info("Prometheus discovery file %s names %s", path, url)
    return path


def remove_discovery(path: str | None) -> None:
    if path is None:
        return
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
