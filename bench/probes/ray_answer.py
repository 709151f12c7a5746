"""What a Ray rank pays on its training thread to collect the policy actor's answer to a step's
report one step after sending it (``RayCoordinator.decision``), two ways side by side:

* ``wait_get``: ``ray.wait`` on the call's reference, then ``ray.get`` (LayerCheck before
  2026-12-05): two round trips through Ray's core worker on the training thread;
* ``future``: the reference's ``future()``, taken when the call is sent, read a step later (now):
  Ray fetches and deserializes the answer on a thread of its own as soon as it comes.

Each step sends one call per way to a local actor answering as the policy actor does (a decision
with a plan of quiet steps), sleeps a step's time, then collects both answers, in alternating order,
so the machine's noise falls on both alike.

    python bench/probes/ray_answer.py                 # the table
    python bench/probes/ray_answer.py --json --steps 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import ray
from local_ray import local_ray  # beside it in bench/probes/

WAYS = ("wait_get", "future")


@ray.remote(num_cpus=0)
class _Policy:
    """Answers a report as ``PolicyActor.report`` does once every rank is in."""

    def report(self, step: int, plan_steps: int) -> dict[str, Any]:
        plan = [{"step": step + i, "layers": {}, "base": False} for i in range(1, plan_steps + 1)]
        return {"step": step, "layers": {"block.3": "schedule"}, "base": False, "stop": False, "plan": plan}


def _collectors() -> dict[str, tuple[Callable[[ray.ObjectRef], Any], Callable[[Any], Any]]]:
    """Per way: what is kept when the call is sent, and how the answer is collected from it."""

    def wait_get(ref: ray.ObjectRef) -> Any:
        ray.wait([ref], timeout=0.5)
        return ray.get(ref)

    return {
        "wait_get": (lambda ref: ref, wait_get),
        "future": (lambda ref: ref.future(), lambda future: future.result(timeout=10)),
    }


def run(steps: int, step_s: float, plan_steps: int = 9) -> dict[str, Any]:
    """Medians and 90th percentiles of each way's collection time over ``steps`` after 10 warm-up steps."""
    with local_ray():
        policy = _Policy.remote()  # type: ignore[attr-defined]  # @ray.remote class (python/mypy#3135)
        ray.get(policy.report.remote(0, plan_steps))
        ways = _collectors()
        samples: dict[str, list[float]] = {way: [] for way in WAYS}
        for step in range(1, 11 + steps):
            kept = {way: keep(policy.report.remote(step, plan_steps)) for way, (keep, _) in ways.items()}
            time.sleep(step_s)  # the next training step: the answer is in long before it ends
            for way in WAYS if step % 2 else reversed(WAYS):
                start = time.perf_counter()
                answer = ways[way][1](kept[way])
                if step > 10:
                    samples[way].append(time.perf_counter() - start)
                assert answer["step"] == step
    out: dict[str, Any] = {"steps": steps, "step_s": step_s}
    for way, times in samples.items():
        out[f"{way}_s"] = statistics.median(times)
        out[f"{way}_s_p90"] = statistics.quantiles(times, n=10)[-1]
    out["future_vs_wait_get"] = out["future_s"] / out["wait_get_s"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="timed steps (after 10 warm-up)")
    parser.add_argument("--step-s", type=float, default=0.05, help="seconds between sending and collecting")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args(argv)
    result = run(args.steps, args.step_s)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"collecting the policy's answer a step ({args.step_s:g} s) after the report, {args.steps} steps")
    for way, label in (("wait_get", "ray.wait + ray.get"), ("future", "ObjectRef.future()")):
        print(f"{label:<20} median {result[f'{way}_s'] * 1e6:7.0f} µs, p90 {result[f'{way}_s_p90'] * 1e6:7.0f} µs")
    print(f"future / wait+get    {result['future_vs_wait_get']:.2f}x (medians)")


if __name__ == "__main__":
    main()
