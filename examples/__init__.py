"""Runnable examples and bundled data, shipped with the package: the run configs
(``demo.toml``, ``sft.toml``, ``cluster.toml``), the demo corpus and the SFT chat set
(``data/``), and scripts for an own Ray Train loop and a Hugging Face / TRL run."""
