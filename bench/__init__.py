"""Benchmarks: scripts that train one workload under every strategy, or time one piece (the drift
probe, the snapshot stall, the capture rate), and print figures as a table and JSON.
``layercheck bench`` is the entry point; ``python -m layercheck.bench.<script>`` runs one."""
