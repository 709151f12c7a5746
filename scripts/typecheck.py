"""The type check CI runs (``./dev typecheck``): mypy over the package ``layercheck`` as it installs.

The repository keeps its folders by role and pyproject's ``[tool.setuptools.package-dir]`` maps
them under ``layercheck.`` (``workers/`` installs as ``layercheck.workers``); the editable install
does that mapping with an import hook, which mypy does not follow. So this script hands mypy every
module of the installed layout itself: each ``.py`` file of each package in
``[tool.setuptools].packages``, under the module name it installs as and at its real path in the
checkout (``scripts/package_layout.py`` reads that layout from pyproject, for the layering test too).
Imports between them resolve by those names, errors name the real files, and nothing is laid out on
disk. The research probes (``bench/probes/``, not installed) are checked with them, each as the
top-level module it is when run as a script (``python bench/probes/fused_issue.py``), so their imports
of each other resolve as they do then. The settings are pyproject's ``[tool.mypy]``; arguments go on to mypy (e.g.
``--no-incremental``); the exit status is mypy's (0 clean, 1 errors, 2 a blocking error).

mypy documents only ``mypy.api`` as stable; this uses ``mypy.main.process_options`` and
``run_build`` (what the ``mypy`` command itself runs) and ``BuildSource``, with the mypy version
pinned in pyproject's test extras.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from mypy import util
from mypy.fscache import FileSystemCache
from mypy.main import process_options, run_build
from mypy.modulefinder import BuildSource
from package_layout import installed_modules, not_installed_modules, read_pyproject  # its sibling

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    t0 = time.time()
    os.chdir(ROOT)
    try:
        modules = installed_modules(read_pyproject(ROOT), ROOT)
    except ValueError as error:
        raise SystemExit(f"typecheck: {error}") from None
    fscache = FileSystemCache()
    # require_targets=False: the targets are ours, not the command line's
    targets, options = process_options(
        ["--config-file", "pyproject.toml", *argv], require_targets=False, fscache=fscache
    )
    if targets:
        raise SystemExit("typecheck: it checks the whole package; pass mypy options only, no files or modules")
    sources = [BuildSource(path.as_posix(), module) for module, path in modules]
    # the probes (bench/probes/), not installed: top-level modules, as when run as scripts
    sources += [BuildSource(path.as_posix(), path.stem) for path in not_installed_modules(ROOT)]
    # run_build prints each message as mypy finds it; the summary line is printed here
    _, messages, blockers = run_build(sources, options, fscache, t0, sys.stdout, sys.stderr)
    formatter = util.FancyFormatter(sys.stdout, sys.stderr, options.hide_error_codes)
    n_errors, n_notes, n_files = util.count_stats(messages)
    color = options.color_output
    if n_errors:
        print(formatter.format_error(n_errors, n_files, len(sources), blockers=blockers, use_color=color))
    else:
        print(formatter.format_success(len(sources), use_color=color))
    if blockers:
        return 2
    return 1 if messages and n_notes < len(messages) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
