"""Helpers for the tests that run ``layercheck train`` as a user does: a subprocess in its own
process group (so a signal can go to the whole group, as a terminal sends it), its progress
read from stdout, its stderr in a file (a pipe nobody reads would fill and stall the run), and
cleanup of every process the driver started when it was killed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_PROGRESS = re.compile(r"\] step (\d+) ")


@dataclass
class TrainProcess:
    proc: subprocess.Popen
    stderr_path: Path
    lines: list[str] = field(default_factory=list)
    """The stdout lines read so far."""

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_for_step(self, step: int) -> int:
        """Read progress until it shows a step at or past ``step`` (progress is polled, so not
        every step is printed); returns the step shown. Fails if the run ends first."""
        for line in self.proc.stdout:
            self.lines.append(line)
            shown = _PROGRESS.search(line)
            if shown and int(shown.group(1)) >= step:
                return int(shown.group(1))
        raise AssertionError(f"the run ended before step {step}:\n{''.join(self.lines)[-2000:]}{self.stderr[-3000:]}")

    def finish(self, timeout: float = 600) -> str:
        """Wait for the run to end; all of its stdout."""
        out, _ = self.proc.communicate(timeout=timeout)
        return "".join(self.lines) + out


def start_train(
    tmp_path: Path, *sets: str, ray_tmp: Path, args: tuple[str, ...] = (), config: str = "examples/demo.toml"
) -> TrainProcess:
    """``layercheck train CONFIG --set …`` from this worktree, with a local Ray it starts itself
    and the test's environment (an ``s3`` fixture's credentials too). ``RAY_ADDRESS`` is unset
    and Ray's temporary directory is ``ray_tmp`` (the ``ray_tmp`` fixture): the driver must not
    join a cluster some other process started with ``ray start`` on this machine."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    env["RAY_TMPDIR"] = str(ray_tmp)
    command = [sys.executable, "-m", "layercheck.orchestrator.cli.main", "train", config]
    for assignment in sets:
        command += ["--set", assignment]
    stderr_path = tmp_path / f"train-{time.monotonic_ns()}.stderr"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            [*command, *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
    return TrainProcess(proc=proc, stderr_path=stderr_path)


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, their children…), from /proc."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


def kill_run(run: TrainProcess, *, timeout: float = 60) -> set[int]:
    """SIGKILL the driver alone (what the OOM killer or ``kill -9`` does); then SIGKILL what it
    had started and left behind (its local Ray: GCS, raylet, workers), found among its
    descendants taken just before and in its process group: nothing of other tests' Ray.
    Returns the pids that outlived the driver."""
    pid = run.proc.pid
    started = descendants(pid)
    os.kill(pid, signal.SIGKILL)
    run.proc.wait(timeout=timeout)
    survivors = {p for p in started if _alive(p)}
    for p in survivors:
        _kill(p)
    try:
        os.killpg(pid, signal.SIGKILL)  # the driver led its own group (start_new_session)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in started if _alive(p)], "processes of the killed driver outlived the cleanup"
    return survivors


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
