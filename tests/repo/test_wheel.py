"""The wheel and the sdist, built from this working tree and used the way someone who installs
the wheel uses them: from a fresh virtual environment outside the checkout, with the working
directory outside it too.

One module fixture builds once and installs once; each test checks one fact:

- ``python -m build`` makes the sdist and then the wheel *from the sdist* (its default), so a
  wheel that builds is proof the sdist holds what building needs; the sdist listing is checked
  for the data files as well, and for what it must not carry;
- the wheel holds every module of every mapped folder and the package data (example configs,
  the bundled corpus, SFT set and tokenizer, dashboards and alert rules), none of the research
  probes (``bench/probes/``, run from a checkout), and installs nothing at the top level of
  site-packages but ``layercheck`` and its dist-info;
- in the fresh environment ``import layercheck`` resolves to the installed wheel, not to the
  checkout, and the wheel's declared dependencies are met;
- ``layercheck --help``, ``layercheck config`` and a short ``layercheck demo`` run there; the
  demo's injected SIGKILL is recovered from its checkpoints at ``t_fail + 1``.

How the dependencies are provided, and why: installing torch, Ray, DeepSpeed and transformers
into a fresh environment takes minutes and the network, too much for CI. So the fresh
environment is made with ``python -m venv --without-pip``, the wheel is installed into it with
``pip --python FRESH install --no-deps --no-index`` (the project environment's pip, before the
next step, so pip never sees the checkout's editable install as one to replace), and then a
``.pth`` file in the fresh site-packages names the project environment's site-packages (a plain
path line). Python appends that directory to ``sys.path`` *after* the fresh site-packages, so
the wheel's ``layercheck`` wins; and ``.pth`` files inside a directory added that way are not
processed, so the checkout's editable-install hook (``__editable__.layercheck-*.pth``) stays
inert. ``--without-pip`` keeps the fresh environment free of the interpreter's bundled (older)
setuptools, which would otherwise shadow the one torch requires. The test asserts that the
import resolves into the fresh environment and that the wheel's requirements are satisfied
there (``pip check`` and a direct comparison with ``importlib.metadata.requires``).

The build runs ``--no-isolation``: an isolated build installs setuptools from an index, which a
CI machine may not reach; the project environment's setuptools (torch requires >= 77) meets
``build-system.requires``, and ``build`` still checks that it does.

The build reads a copy of the working tree (the files a commit would hold), not the checkout
itself: setuptools re-reads an existing ``layercheck.egg-info/SOURCES.txt`` into the sdist, and
a checkout's editable install leaves one, so an in-place build could ship what a fresh clone's
would not, and it would write into the checkout."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.checkout import package_layout

ROOT = Path(__file__).resolve().parents[2]
DEPS_PTH = "_layercheck_test_deps.pth"

#: The demo, short: 12 steps, rank 1 SIGKILLed after step 6. Every layer is saved within the
#: first 3 steps (period 3, no warm-up, no bandwidth-derived stretching of the periods), so the
#: recovery has a version of each layer at or before step 6 and resumes at step 7.
DEMO_SETTINGS = {
    "steps": 12,
    "optim.total_steps": 12,
    "optim.warmup_steps": 2,
    "policy.period": 3,
    "policy.smax": 6,
    "policy.warmup_steps": 0,
    "persistence.write_budget.enabled": "false",
    "fault.kill_at_step": 6,
    "metrics.port": 0,
}
KILL_AT = DEMO_SETTINGS["fault.kill_at_step"]


@dataclass
class Installed:
    sdist: Path
    wheel: Path
    build_log: str
    venv: Path
    site: Path
    """The fresh environment's site-packages."""
    cwd: Path
    """A working directory outside the checkout."""

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def run(self, *command: str | Path, timeout: float = 120, **env_vars: str) -> subprocess.CompletedProcess:
        """``command`` in the fresh environment (its ``bin`` first on ``PATH``), from ``cwd``,
        with nothing of the caller's environment that could point back into the checkout, and
        ``env_vars`` set."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "RAY_ADDRESS")}
        env.update(env_vars, VIRTUAL_ENV=str(self.venv), PIP_DISABLE_PIP_VERSION_CHECK="1")
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return _run([str(c) for c in command], cwd=self.cwd, env=env, timeout=timeout)


def _run(
    command: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float
) -> subprocess.CompletedProcess:
    """Run in its own process group; on a timeout the whole group (a driver's local Ray
    too) is killed before the failure is reported."""
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{command} ran past {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, (
        f"{result.args} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    )
    return result.stdout


def _copy_worktree(dest: Path) -> None:
    """The files a commit of this working tree would hold: tracked and untracked-but-not-ignored
    ones (what git lists), else, outside a git checkout, everything but the usual build
    outputs."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        skip = (".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", "runs", ".*_cache", ".hypothesis")
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(*skip))
        return
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def _project_site_dirs() -> list[str]:
    """Where this (the project's) environment keeps its installed distributions."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    base = tmp_path_factory.mktemp("wheel")
    assert ROOT not in base.parents, "the test's folders must lie outside the checkout"
    src, dist, venv, cwd = base / "src", base / "dist", base / "venv", base / "elsewhere"
    cwd.mkdir()
    _copy_worktree(src)

    build = _run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)], cwd=base, timeout=300
    )
    build_log = _ok(build) + build.stderr
    (sdist,) = dist.glob("layercheck-*.tar.gz")
    (wheel,) = dist.glob("layercheck-*.whl")

    _ok(_run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=base, timeout=120))
    fresh_python = venv / "bin" / "python"
    _ok(
        _run(
            [sys.executable, "-m", "pip", "--python", str(fresh_python), "install", "-q", "--no-deps", "--no-index"]
            + ["--disable-pip-version-check", str(wheel)],
            cwd=base,
            timeout=180,
        )
    )
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(_ok(_run([str(fresh_python), "-c", where], cwd=cwd, timeout=60)).strip())
    assert venv in site.parents
    (site / DEPS_PTH).write_text("".join(f"{path}\n" for path in _project_site_dirs()))
    return Installed(sdist=sdist, wheel=wheel, build_log=build_log, venv=venv, site=site, cwd=cwd)


LAYOUT = package_layout()


def _pyproject() -> dict:
    return LAYOUT.read_pyproject(ROOT)


def _package_data_files() -> list[tuple[str, str]]:
    """Every file the package-data globs of pyproject match in the checkout: its path in the
    checkout (and the sdist) and its path in the wheel, e.g. ``("examples/demo.toml",
    "layercheck/examples/demo.toml")``. Each glob must match something."""
    pyproject = _pyproject()
    folders = LAYOUT.package_folders(pyproject)
    found = []
    for package, globs in pyproject["tool"]["setuptools"]["package-data"].items():
        folder = folders[package]
        for pattern in globs:
            matched = [p.relative_to(ROOT / folder) for p in (ROOT / folder).glob(pattern) if p.is_file()]
            assert matched, f"{package}: {pattern} matches nothing in {folder}"
            found += [((folder / m).as_posix(), f"{package.replace('.', '/')}/{m.as_posix()}") for m in matched]
    return found


#: The package data the issue names: examples/*.toml, the bundled data, the dashboards.
REQUIRED_DATA = [
    "layercheck/examples/demo.toml",
    "layercheck/examples/sft.toml",
    "layercheck/examples/cluster.toml",
    "layercheck/examples/data/corpus.txt",
    "layercheck/examples/data/sft.jsonl",
    "layercheck/examples/data/sft-tokenizer/tokenizer.json",
    "layercheck/examples/data/sft-tokenizer/tokenizer_config.json",
    "layercheck/dashboards/layercheck-dashboard.json",
    "layercheck/dashboards/prometheus.yml",
    "layercheck/dashboards/alerts.yml",
]


@pytest.mark.slow
def test_the_wheel_is_built_from_the_sdist_which_holds_the_sources_and_data(installed):
    assert "Building wheel from sdist" in installed.build_log
    with tarfile.open(installed.sdist) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "PKG-INFO", "MANIFEST.in"} <= names
    folders = _pyproject()["tool"]["setuptools"]["package-dir"]
    for package, folder in folders.items():
        assert f"{folder}/__init__.py" in names, package
    data = {source for source, _ in _package_data_files()}
    assert data <= names, sorted(data - names)
    # MANIFEST.in: neither the test suite (it needs the checkout), the committed bench results nor the probes
    left_out = ("tests/", "bench/results/", *(f"{folder.as_posix()}/" for folder in LAYOUT.NOT_INSTALLED))
    assert not [n for n in names if n.startswith(left_out) and not n.endswith("/")]
    assert not [n for n in names if n.endswith((".pyc", ".pyo"))]


@pytest.mark.slow
def test_the_wheel_holds_every_module_and_the_package_data(installed):
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
    assert set(REQUIRED_DATA) <= names, sorted(set(REQUIRED_DATA) - names)
    data = {in_wheel for _, in_wheel in _package_data_files()}
    assert data <= names, sorted(data - names)
    # every module of every mapped folder but the probes: a subpackage left out of
    # [tool.setuptools] packages would be missing here (and from an installed layercheck) while the
    # checkout still works
    probes = [ROOT / folder for folder in LAYOUT.NOT_INSTALLED]
    for package, folder in _pyproject()["tool"]["setuptools"]["package-dir"].items():
        modules = {
            f"{package.replace('.', '/')}/{p.relative_to(ROOT / folder).as_posix()}"
            for p in (ROOT / folder).rglob("*.py")
            if "__pycache__" not in p.parts and not any(p.is_relative_to(probe) for probe in probes)
        }
        assert modules and modules <= names, (package, sorted(modules - names))
    assert not [n for n in names if "/bench/results/" in n or n.endswith(".pyc")]
    # the probes (bench/probes/) are no part of it, under their folder or beside the bench's modules
    probe_files = LAYOUT.not_installed_modules(ROOT)
    assert probe_files and not [n for n in names if n.startswith("layercheck/bench/probes/")]
    assert not {f"layercheck/bench/{p.name}" for p in probe_files} & names


@pytest.mark.slow
def test_nothing_but_layercheck_and_its_dist_info_lands_in_site_packages(installed):
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = wheel.namelist()
        (record,) = [n for n in names if n.endswith(".dist-info/RECORD")]
        recorded = [line.split(",", 1)[0] for line in wheel.read(record).decode().splitlines() if line]
    dist_info = record.split("/", 1)[0]
    assert {n.split("/", 1)[0] for n in names} == {"layercheck", dist_info}
    assert {n.split("/", 1)[0] for n in recorded} == {"layercheck", dist_info}
    # what pip put there (its RECORD lists the console script under ../../../bin as well)
    assert set(os.listdir(installed.site)) == {"layercheck", dist_info, DEPS_PTH}
    assert (installed.venv / "bin" / "layercheck").is_file()


@pytest.mark.slow
def test_import_layercheck_in_the_fresh_environment_resolves_to_the_wheel(installed):
    probe = (
        "import importlib, importlib.metadata as md, importlib.resources as r, json, sys, layercheck\n"
        "cli = importlib.import_module('layercheck.orchestrator.cli.main')  # the console script's module\n"
        "print(json.dumps({'layercheck': layercheck.__file__, 'cli': cli.__file__,\n"
        "    'examples': str(r.files('layercheck.examples')), 'dashboards': str(r.files('layercheck.dashboards')),\n"
        "    'dist': str(md.distribution('layercheck').locate_file('')), 'path': sys.path,\n"
        "    'editable': [m for m in sys.modules if '__editable__' in m]}))\n"
    )
    seen = json.loads(_ok(installed.run(installed.python, "-c", probe)))
    for key in ("layercheck", "cli", "examples", "dashboards", "dist"):
        assert Path(seen[key]).is_relative_to(installed.site), (key, seen[key])
    # nothing of the checkout on sys.path but the dependencies' site-packages (under it when the
    # project environment is the checkout's .venv)
    deps = [Path(d).resolve() for d in _project_site_dirs()]
    from_checkout = [
        p
        for p in map(Path, filter(None, seen["path"]))
        if p.resolve().is_relative_to(ROOT) and not any(p.resolve().is_relative_to(d) for d in deps)
    ]
    assert from_checkout == [], seen["path"]
    assert seen["editable"] == []  # the checkout's editable-install finder never ran


@pytest.mark.slow
def test_the_wheels_declared_dependencies_are_met_in_the_fresh_environment(installed):
    # every requirement of the wheel's metadata (and of the extras it asks for, e.g. ray[train])
    # against what the fresh environment imports; pip check for the environment as a whole
    probe = (
        "import importlib.metadata as md, json\n"
        "from packaging.requirements import Requirement\n"
        "unmet, checked = [], []\n"
        "def check(req, extras=('',)):\n"
        "    r = Requirement(req)\n"
        "    if r.marker and not any(r.marker.evaluate({'extra': e}) for e in extras):\n"
        "        return\n"
        "    try:\n"
        "        version = md.version(r.name)\n"
        "    except md.PackageNotFoundError:\n"
        "        unmet.append(f'{req}: not installed')\n"
        "        return\n"
        "    checked.append(r.name)\n"
        "    if not r.specifier.contains(version, prereleases=True):\n"
        "        unmet.append(f'{req}: {version}')\n"
        "    if extras == ('',):  # the extras asked for, one level down\n"
        "        for sub in md.requires(r.name) or []:\n"
        "            s = Requirement(sub)\n"
        "            if r.extras and s.marker and not s.marker.evaluate({'extra': ''}):\n"
        "                check(sub, tuple(r.extras))\n"
        "for req in md.requires('layercheck'):\n"
        "    check(req)\n"
        "print(json.dumps({'unmet': unmet, 'checked': checked}))\n"
    )
    seen = json.loads(_ok(installed.run(installed.python, "-c", probe)))
    assert seen["unmet"] == []
    assert {"ray", "torch", "deepspeed", "transformers"} <= set(seen["checked"])
    assert "No broken requirements found" in _ok(installed.run(installed.python, "-m", "pip", "check"))


@pytest.mark.slow
def test_layercheck_help_and_config_run_from_the_wheel(installed):
    usage = _ok(installed.run("layercheck", "--help"))
    assert "usage: layercheck" in usage and "demo" in usage and "config" in usage
    fields = _ok(installed.run("layercheck", "config"))
    assert "steps = " in fields and "[policy" in fields and "[fault]" in fields


@pytest.mark.slow
def test_layercheck_demo_from_the_wheel_recovers_its_sigkilled_worker(installed):
    sets = [arg for key, value in DEMO_SETTINGS.items() for arg in ("--set", f"{key}={value}")]
    ray_tmp = Path(tempfile.mkdtemp(prefix="lcwhl-", dir="/tmp"))  # short: Ray's socket paths must fit
    try:
        result = installed.run("layercheck", "demo", "--json", *sets, timeout=480, RAY_TMPDIR=str(ray_tmp))
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    summary = json.loads(_ok(result))
    assert (summary["state"], summary["error"], summary["steps"]) == ("finished", None, DEMO_SETTINGS["steps"])
    assert summary["failures"] == 1 and len(summary["recoveries"]) == 1, summary["recoveries"]
    (recovery,) = summary["recoveries"]
    # no rollback: training went on at t_fail + 1 from the composite of checkpointed layers
    assert (recovery["t_fail"], recovery["resumed_at"]) == (KILL_AT, KILL_AT + 1), recovery
    assert "SIGKILL" in result.stderr
    # the default storage, runs/{name}, is relative to the working directory: outside the checkout
    storage = Path(summary["storage"])
    assert storage == installed.cwd / "runs" / "demo" and (storage / "manifest").exists()
