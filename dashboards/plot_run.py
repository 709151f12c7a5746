"""Render one LayerCheck run, as a Prometheus server stored it, to a PNG: the layer × time
staleness heatmap, max and weighted staleness against Smax, bytes written against full
checkpoints, and ETTR with the training step.

    python dashboards/plot_run.py --prometheus http://127.0.0.1:9090 --run-id demo-1a2b3c4d \\
        --out dashboards/demo-run.png

Needs matplotlib (``pip install -e '.[plot]'``). Reads only Prometheus's HTTP query API.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.parse
import urllib.request

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

Series = dict[str, tuple[np.ndarray, np.ndarray]]  # label value -> (timestamps, values)


def query(prometheus: str, path: str, **params: object) -> list[dict]:
    url = f"{prometheus.rstrip('/')}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=30) as response:
        body = json.load(response)
    if body["status"] != "success":
        raise RuntimeError(f"{url}: {body}")
    return body["data"]["result"]


def span(prometheus: str, run_id: str, lookback_s: float) -> tuple[float, float]:
    """First and last scrape of the run within the last ``lookback_s`` seconds."""
    now = time.time()
    result = query(
        prometheus,
        "query_range",
        query=f'layercheck_training_step{{run_id="{run_id}"}}',
        start=now - lookback_s,
        end=now,
        step=1,
    )
    if not result:
        raise SystemExit(f"no series of run {run_id!r} in {prometheus} over the last {lookback_s:.0f} s")
    stamps = [float(t) for r in result for t, _ in r["values"]]
    return min(stamps), max(stamps)


def series(prometheus: str, expr: str, start: float, end: float, by: str = "") -> Series:
    out: Series = {}
    for r in query(prometheus, "query_range", query=expr, start=start, end=end, step=1):
        values = np.array([[float(t), float(v)] for t, v in r["values"]])
        out[r["metric"].get(by, "")] = (values[:, 0] - start, values[:, 1])
    return out


def layer_order(name: str) -> tuple[int, int, str]:
    if name == "embed":
        return (0, 0, name)
    match = re.fullmatch(r"block\.(\d+)", name)
    if match:
        return (1, int(match.group(1)), name)
    return (2, 0 if name == "norm" else 1, name)


def heatmap(ax: plt.Axes, fig: plt.Figure, layers: Series, end_s: float) -> None:
    names = sorted(layers, key=layer_order)
    grid = np.full((len(names), int(end_s) + 1), np.nan)
    for row, name in enumerate(names):
        t, v = layers[name]
        grid[row, np.clip(np.round(t).astype(int), 0, grid.shape[1] - 1)] = v
    image = ax.imshow(
        np.ma.masked_invalid(grid),
        aspect="auto",
        interpolation="nearest",
        cmap="YlOrRd",
        extent=(0, end_s, len(names) - 0.5, -0.5),
    )
    ax.set_yticks(range(len(names)), names)
    ax.set_title("staleness per layer (steps since its newest committed version)")
    fig.colorbar(image, ax=ax, label="steps", pad=0.01)


def lines(ax: plt.Axes, data: list[tuple[Series, str, dict]]) -> None:
    for values, label, style in data:
        for t, v in values.values():
            ax.plot(t, v, label=label, **style)


def idle_spans(steps: Series, min_s: float = 3.0) -> list[tuple[float, float]]:
    """Spans of at least ``min_s`` in which no step completed: workers starting or restarting."""
    spans = []
    for t, v in steps.values():
        begin = None
        for i in range(1, len(t)):
            if v[i] > v[i - 1]:
                if begin is not None and t[i - 1] - begin >= min_s:
                    spans.append((begin, t[i - 1]))
                begin = None
            elif begin is None:
                begin = t[i - 1]
    return spans


def mark_failures(axes: list[plt.Axes], failures: Series) -> None:
    for t, v in failures.values():
        for when in t[1:][np.diff(v) > 0]:
            for ax in axes:
                ax.axvline(when, color="black", linestyle=":", linewidth=1)
            axes[0].annotate(
                "recovery",
                (when, 0),
                xytext=(3, 3),
                textcoords="offset points",
                fontsize=8,
                color="black",
                xycoords=("data", "axes fraction"),
            )


def render(prometheus: str, run_id: str, out: str, lookback_s: float = 3600.0) -> None:
    start, end = span(prometheus, run_id, lookback_s)
    q = lambda expr, by="": series(prometheus, expr.replace("RUN", f'run_id="{run_id}"'), start, end, by)  # noqa: E731
    fig, axes = plt.subplots(2, 2, figsize=(13, 7.5), constrained_layout=True)
    (top_left, top_right), (bottom_left, bottom_right) = axes
    heatmap(top_left, fig, q("layercheck_layer_staleness_steps{RUN}", "layer"), end - start)

    lines(
        top_right,
        [
            (q("layercheck_staleness_max_steps{RUN}"), "max staleness", {"color": "tab:red"}),
            (q("layercheck_staleness_weighted_steps{RUN}"), "weighted staleness", {"color": "tab:blue"}),
            (q("layercheck_smax_steps{RUN}"), "Smax", {"color": "black", "linestyle": "--"}),
        ],
    )
    top_right.set(title="staleness against the budget Smax", ylabel="steps")
    mib = lambda s: {k: (t, v / 2**20) for k, (t, v) in s.items()}  # noqa: E731
    lines(
        bottom_left,
        [
            (mib(q("layercheck_committed_bytes_total{RUN}")), "LayerCheck, committed", {"color": "tab:green"}),
            (
                mib(q("layercheck_full_checkpoint_equivalent_bytes{RUN}")),
                "full checkpoints at the same mean staleness",
                {"color": "tab:purple", "linestyle": "--"},
            ),
        ],
    )
    bottom_left.set(title="bytes written against fixed-interval full checkpoints", ylabel="MiB")
    lines(
        bottom_right,
        [
            (q("layercheck_ettr_ratio{RUN}"), "ETTR", {"color": "tab:orange", "linewidth": 2}),
            (q("layercheck_ettr_recent_ratio{RUN}"), "ETTR, last 60 s", {"color": "tab:brown", "linestyle": "--"}),
        ],
    )
    bottom_right.set(title="effective training time ratio and progress", ylabel="ETTR", ylim=(0, 1.05))
    steps = bottom_right.twinx()
    step_series = q("layercheck_training_step{RUN}")
    lines(steps, [(step_series, "training step", {"color": "tab:gray"})])
    steps.set_ylabel("step")
    for ax in axes.flat:
        ax.set_xlabel("seconds since the first scrape")
        ax.set_xlim(0, end - start)
    for i, (begin, end_s) in enumerate(idle_spans(step_series)):
        for ax in (top_right, bottom_left, bottom_right):  # the heatmap shows frozen staleness there
            ax.axvspan(
                begin, end_s, color="0.85", zorder=0, label="no step trained (start, restart)" if i == 0 else None
            )
    mark_failures([top_left, top_right, bottom_left, bottom_right], q("layercheck_failures_total{RUN}"))
    handles = [h for ax in (bottom_right, steps) for h in ax.get_legend_handles_labels()[0]]
    bottom_right.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
    for ax in (top_right, bottom_left):
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"LayerCheck run {run_id}, as scraped by Prometheus")
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus server URL")
    parser.add_argument("--run-id", required=True, help="the run_id label of the run")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--lookback", type=float, default=3600.0, help="seconds of history to search")
    args = parser.parse_args(argv)
    render(args.prometheus, args.run_id, args.out, args.lookback)
    return 0


if __name__ == "__main__":
    sys.exit(main())
