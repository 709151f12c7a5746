"""The package's layout as pyproject declares it, read in one place: which folder each package of
``[tool.setuptools] packages`` installs from (``package-dir``), the modules it installs, and the
folders of Python that install nothing.

``scripts/typecheck.py`` hands mypy these modules; ``tests/repo/test_layering.py`` checks the import
rules on them and fails on a folder of Python under a mapped folder that is not a declared package
(it would be missing from the wheel while the checkout still imports it); ``tests/repo/test_wheel.py``
compares the wheel with them. scripts/ is not a package: the script imports this module as its
sibling (its folder is first on ``sys.path``), the tests load it by path.
"""

from __future__ import annotations

from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

#: Folders of Python inside a mapped folder that are deliberately not packages of the wheel: the
#: research probes, run from a checkout (``python bench/probes/<name>.py``, bench/README.md) and
#: left out of the sdist too (MANIFEST.in). Everything below them is left out with them.
NOT_INSTALLED = (Path("bench/probes"),)


def read_pyproject(root: Path) -> dict:
    with open(root / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def package_folders(pyproject: dict) -> dict[str, Path]:
    """Each declared package and the folder it installs from, relative to the checkout: the longest
    mapped prefix in ``package-dir`` decides, as setuptools does."""
    setuptools = pyproject["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools.get("package-dir", {})
    folders = {}
    for package in setuptools["packages"]:
        parts = package.split(".")
        for n in range(len(parts), 0, -1):
            prefix = ".".join(parts[:n])
            if prefix in package_dir:
                folders[package] = Path(package_dir[prefix], *parts[n:])
                break
        else:
            folders[package] = Path(*parts)
    return folders


def installed_modules(pyproject: dict, root: Path) -> list[tuple[str, Path]]:
    """(module name, path relative to the checkout) of each module the wheel installs: the ``.py``
    files of each declared package's own folder (a subfolder is a package of its own, or nothing).
    Raises ValueError for a declared package with no modules."""
    modules = []
    for package, folder in package_folders(pyproject).items():
        files = sorted(p.relative_to(root) for p in (root / folder).glob("*.py"))
        if not files:
            raise ValueError(f"package {package} has no modules in {folder}/")
        modules += [(package if p.stem == "__init__" else f"{package}.{p.stem}", p) for p in files]
    return modules


def not_installed_modules(root: Path) -> list[Path]:
    """Every ``.py`` file under :data:`NOT_INSTALLED`, relative to the checkout."""
    return sorted(p.relative_to(root) for folder in NOT_INSTALLED for p in (root / folder).rglob("*.py"))


def undeclared_folders(pyproject: dict, root: Path) -> list[Path]:
    """Folders under a mapped folder (``package-dir``) that hold ``.py`` files but are neither a
    declared package's folder nor in (or below) :data:`NOT_INSTALLED`: what the wheel would leave
    out without a word."""
    declared = set(package_folders(pyproject).values())
    mapped = {Path(f) for f in pyproject["tool"]["setuptools"].get("package-dir", {}).values()}
    found = set()
    for top in mapped:
        for path in (root / top).rglob("*.py"):
            folder = path.parent.relative_to(root)
            if folder not in declared and not any(folder.is_relative_to(n) for n in NOT_INSTALLED):
                found.add(folder)
    return sorted(found)
