"""The scale harness (``layercheck bench --scale``): the product's policy actor, supervisor, writer
actors, store and recovery plan on a local multi-node Ray cluster, driven by N simulated ranks that
run the real per-step protocol (:class:`~layercheck.workers.loop.StepProtocol` over a
:class:`~layercheck.orchestrator.runtime.ray_coordinator.RayCoordinator`) on synthetic layer shards
shaped like a real model's layer table, many ranks to a process. What it measures grows with N or
with the run's length, never with the model's bytes, which are scaled down to fit one machine.
Ray Train's own controller is not in it: the ranks are protocols, not Ray Train workers."""
