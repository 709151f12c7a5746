"""A process without a main of ours (a Ray actor, the train function, a spawned rank) shows our
warnings with their level and logger once it calls configure_process_logging, and a handler the
user configured first wins."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT)},
    )
    return done.stderr


def test_a_fresh_process_shows_level_and_logger():
    err = run_python(
        "import logging\n"
        "from layercheck.orchestrator.logs import configure_process_logging\n"
        "configure_process_logging()\n"
        "logging.getLogger('orchestrator.x').info('not shown')\n"
        "logging.getLogger('orchestrator.x').warning('shown')\n"
    )
    assert err.strip() == "WARNING orchestrator.x: shown"


def test_a_handler_configured_first_wins():
    err = run_python(
        "import logging\n"
        "logging.basicConfig(level=logging.INFO, format='mine %(message)s')\n"
        "from layercheck.orchestrator.logs import configure_process_logging\n"
        "configure_process_logging()\n"
        "logging.getLogger('orchestrator.x').info('kept')\n"
    )
    assert err.strip() == "mine kept"
