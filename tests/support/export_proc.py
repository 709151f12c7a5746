"""``layercheck`` in a process that SIGKILLs itself at an exact point of an export's write, for
the tests of an interrupted export: ``LAYERCHECK_TEST_KILL_IN=safe_save_file`` kills it as
transformers starts writing a model's weights (its config is written by then).

    LAYERCHECK_TEST_KILL_IN=safe_save_file python -m tests.support.export_proc export RUN --format hf --out OUT
"""

from __future__ import annotations

import os
import signal
import sys

import transformers.modeling_utils

from layercheck.orchestrator.cli.main import main


def _killed(*args, **kwargs) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    if os.environ.get("LAYERCHECK_TEST_KILL_IN") == "safe_save_file":
        transformers.modeling_utils.safe_save_file = _killed
    sys.exit(main(sys.argv[1:]))
