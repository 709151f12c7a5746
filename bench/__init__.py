"""Benchmarks: scripts that train one workload under every strategy, or time one piece (the drift
probe, the recovery paths), and print figures as a table and JSON. ``layercheck bench`` is the entry
point; ``python -m layercheck.bench.<script>`` runs one. The research probes, each of which answered
one question (the snapshot stall, the capture rate, ...), are not part of the package: they live in
``bench/probes/`` of a checkout and run as scripts there (bench/README.md)."""
