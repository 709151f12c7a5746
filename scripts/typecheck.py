"""The type check CI runs (``./dev typecheck``): mypy over the package ``layercheck`` as it installs.

The repository keeps its folders by role and pyproject's ``[tool.setuptools.package-dir]`` maps
them under ``layercheck.`` (``workers/`` installs as ``layercheck.workers``); the editable install
does that mapping with an import hook, which mypy does not follow. So this script hands mypy every
module of the installed layout itself: each ``.py`` file of each package in
``[tool.setuptools].packages``, under the module name it installs as and at its real path in the
checkout. Imports between them resolve by those names, errors name the real files, and nothing is
laid out on disk. The settings are pyproject's ``[tool.mypy]``; arguments go on to mypy (e.g.
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

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: mypy depends on tomli there
    import tomli as tomllib

from mypy import util
from mypy.fscache import FileSystemCache
from mypy.main import process_options, run_build
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parent.parent


def installed_modules(pyproject: dict) -> list[tuple[str, str]]:
    """(module name, path relative to the checkout) of each module the package installs."""
    setuptools = pyproject["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools["package-dir"]
    modules = []
    for package in setuptools["packages"]:
        # the longest mapped prefix of the package decides its folder, as setuptools does
        parts = package.split(".")
        for n in range(len(parts), 0, -1):
            prefix = ".".join(parts[:n])
            if prefix in package_dir:
                folder = Path(package_dir[prefix], *parts[n:])
                break
        else:
            folder = Path(*parts)
        files = sorted(folder.glob("*.py"))
        if not files:
            raise SystemExit(f"typecheck: package {package} has no modules in {folder}/")
        for path in files:
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules.append((name, path.as_posix()))
    return modules


def main(argv: list[str]) -> int:
    t0 = time.time()
    os.chdir(ROOT)
    with open("pyproject.toml", "rb") as f:
        pyproject = tomllib.load(f)
    fscache = FileSystemCache()
    # require_targets=False: the targets are ours, not the command line's
    targets, options = process_options(
        ["--config-file", "pyproject.toml", *argv], require_targets=False, fscache=fscache
    )
    if targets:
        raise SystemExit("typecheck: it checks the whole package; pass mypy options only, no files or modules")
    sources = [BuildSource(path, module) for module, path in installed_modules(pyproject)]
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
