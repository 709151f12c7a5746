"""A writer process for the store tests: commits versions of some layers, and can be told (by
``LAYERCHECK_TEST_KILL_AT=event:path-part[#n]``) to SIGKILL itself at an exact point of a write,
the n-th time (default first) the store reaches it — a crash that leaves what a real one would.

    python -m tests.support.store_writer_proc RUN --layers a,b --steps 10,20 [--world-size 2]

With ``--for-s S`` it writes steps on from the first of ``--steps`` (one a step) until ``S``
seconds have passed, a run that keeps committing, and prints ``last step N`` when it is done.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import time

from layercheck.orchestrator.store.layer_store import LayerStore
from tests.support.store_helpers import write_layer


def kill_hook(spec: str):
    point, _, nth = spec.partition("#")
    event, _, part = point.partition(":")
    remaining = [int(nth or 1)]

    def hook(seen_event: str, path: str) -> None:
        if seen_event == event and part in path:
            remaining[0] -= 1
            if remaining[0] == 0:
                os.kill(os.getpid(), signal.SIGKILL)

    return hook


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run")
    parser.add_argument("--layers", required=True)
    parser.add_argument("--steps", required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--for-s", type=float, default=None, help="write steps on from the first until then")
    args = parser.parse_args()
    spec = os.environ.get("LAYERCHECK_TEST_KILL_AT")
    store = LayerStore.open(args.run, hook=kill_hook(spec) if spec else None)
    steps = [int(s) for s in args.steps.split(",")]
    end = None if args.for_s is None else time.monotonic() + args.for_s
    for step in steps if end is None else itertools.count(steps[0]):
        for layer in args.layers.split(","):
            write_layer(store, layer, step, world_size=args.world_size)
        if end is not None and time.monotonic() >= end:
            print(f"last step {step}", flush=True)
            break


if __name__ == "__main__":
    main()
