"""Grafana dashboard, Prometheus configuration and alert rules for LayerCheck's metrics, shipped
with the package (``importlib.resources.files("layercheck.dashboards")``)."""
