"""What the tests share (the fixtures built on it are in ``tests/conftest.py``).

Functions that run in spawned processes or Ray workers must live here, in an importable module,
not in a test module.

- ``models``: the one tiny model config (``TINY_LLAMA``), its variants, the other families' configs.
- ``engines``: the one engine builder (``make_engine``) and what jobs do with an engine.
- ``dist_harness``: ``run_ranks`` (one job on N spawned ranks) and ``run_jobs`` (several, in turn).
- ``*_jobs``: the per-rank jobs of the DeepSpeed tests (worker, composite, capture, overlay,
  attach, freeze, sft, local, budget).
- ``ray_runs``: the demo config shortened, the in-process local Ray, the runs several modules read.
- ``bench_runs``: the benchmark run the harness and capture tests share.
- ``store_helpers``, ``store_writer_proc``: shards of known state, receipts, failing filesystems,
  a writer process that kills itself mid-write (or keeps committing for a while).
- ``export_proc``: ``layercheck`` in a process that kills itself as an export writes its weights.
- ``train_proc``, ``example_runs``: ``layercheck train`` and the examples run as a user runs them.
- ``s3_server``, ``prometheus``, ``dashboards``: a loopback S3 server (cut, flapping, or checking
  credentials), a real Prometheus, the dashboard files.
- ``devices``: the CPU / CUDA switch of the device-dependent tests.
- ``faults``: the test-only failures of a live run (killed writers, stalled writes, a rank's own
  error, failed recoveries), injected through ``LAYERCHECK_FAULTS`` (``injected(FaultPlan(...))``).
"""
