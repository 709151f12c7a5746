"""What the tests share: tiny models and engines, the per-rank jobs spawned processes and Ray
workers import (they must live in an importable module, not a test module), store and process
helpers. The fixtures built on them are in ``tests/conftest.py``."""
