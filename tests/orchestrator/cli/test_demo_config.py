"""``layercheck demo`` (the README's first command) finds and validates its embedded config."""

from layercheck.orchestrator.cli.demo import DEMO_CONFIG
from layercheck.orchestrator.core.run_config import load_run_config


def test_the_demo_runs_the_bundled_config():
    assert DEMO_CONFIG.is_file(), DEMO_CONFIG
    config = load_run_config(DEMO_CONFIG)
    assert config.name == "demo" and config.fault.kill_at_step > 0
