"""What a Ray rank's per-step calls take from its training thread although they leave from a
sending thread of their own (``RayCoordinator``): a Ray actor call's submission runs Python code
in Ray's library, holding the interpreter lock, so a training thread that needs the lock (a
Python-bound step: DeepSpeed's hooks, a GPU step's kernel issue) waits for it.

A stand-in step of many small tensor operations (Python-bound, like issuing kernels) is timed
alone and with, submitted to a sending thread at its start, each of:

* ``report``: one actor call (every rank's drift report);
* ``report+future``: the same, with its answer taken as a future (a measured step's report);
* ``report+progress``: two (rank 0 also sends its progress to the supervisor);
* ``python``: a thread spinning in Python for ``--busy-ms`` (holds the lock: the reference);
* ``native``: a thread multiplying matrices for ``--busy-ms`` (releases the lock: the cores alone).

Every mode runs once per round, in alternating order, so the machine's noise falls on all alike.

    python bench/probes/sender_gil.py                 # the table
    python bench/probes/sender_gil.py --json --rounds 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
import torch
from local_ray import local_ray  # beside it in bench/probes/

MODES = ("none", "report", "report+future", "report+progress", "python", "native")


@ray.remote(num_cpus=0)
class _Actor:
    """Stands in for the policy actor and the supervisor."""

    def report(self, step: int, rank: int, lr: float, l1: dict, counts: dict, measured: bool) -> dict[str, Any]:
        return {"step": step, "plan": []}

    def progress(self, progress: dict[str, Any]) -> None:
        return None


def _senders(busy_s: float) -> dict[str, Callable[[int], None] | None]:
    actor = _Actor.remote()  # type: ignore[attr-defined]  # @ray.remote class (python/mypy#3135)
    ray.get(actor.report.remote(0, 0, 0.0, {}, {}, False))
    matrix = torch.randn(160, 160)

    def report(step: int) -> None:
        actor.report.remote(step, 0, 1e-4, {}, {}, False)

    def report_and_future(step: int) -> None:
        actor.report.remote(step, 0, 1e-4, {}, {}, True).future()

    def report_and_progress(step: int) -> None:
        report(step)
        actor.progress.remote({"step": step, "loss": 1.0, "compute_s": 0.1, "stall_s": 0.0})

    def spin(work: Callable[[], Any]) -> Callable[[int], None]:
        def run(step: int) -> None:
            until = time.perf_counter() + busy_s
            while time.perf_counter() < until:
                work()

        return run

    return {
        "none": None,
        "report": report,
        "report+future": report_and_future,
        "report+progress": report_and_progress,
        "python": spin(lambda: None),
        "native": spin(lambda: matrix @ matrix),
    }


def run(rounds: int, ops: int = 1500, busy_ms: float = 1.0) -> dict[str, Any]:
    """Per mode, the stand-in step's median and its excess over ``none``'s, over ``rounds`` after 20 warm-up rounds."""
    torch.set_num_threads(1)
    with local_ray(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="sender") as sender:
        senders = _senders(busy_ms / 1e3)
        x = torch.zeros(16)
        samples: dict[str, list[float]] = {mode: [] for mode in MODES}
        for round_ in range(20 + rounds):
            for mode in MODES if round_ % 2 else reversed(MODES):
                send = senders[mode]
                if send is not None:
                    sender.submit(send, round_)
                start = time.perf_counter()
                y = x
                for _ in range(ops):  # the step: many small operations, each a trip through Python
                    y = y + 1.0
                if round_ >= 20:
                    samples[mode].append(time.perf_counter() - start)
                sender.submit(lambda: None).result()  # the sends are done before the next mode's step
                time.sleep(0.002)
    medians = {mode: statistics.median(times) for mode, times in samples.items()}
    out: dict[str, Any] = {"rounds": rounds, "ops": ops, "busy_ms": busy_ms}
    for mode, median in medians.items():
        out[f"{mode}_s"] = median
        out[f"{mode}_excess_s"] = median - medians["none"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200, help="timed rounds (after 20 warm-up)")
    parser.add_argument("--ops", type=int, default=1500, help="small tensor operations in the stand-in step")
    parser.add_argument("--busy-ms", type=float, default=1.0, help="how long the python and native threads spin")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args(argv)
    result = run(args.rounds, args.ops, args.busy_ms)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"a Python-bound step ({args.ops} small ops) with a sending thread busy beside it, {args.rounds} rounds")
    for mode in MODES:
        print(
            f"{mode:<16} median {result[f'{mode}_s'] * 1e3:7.3f} ms, "
            f"+{result[f'{mode}_excess_s'] * 1e3:6.3f} ms over the step alone"
        )


if __name__ == "__main__":
    main()
