"""Where a process's CPU goes while the harness measures: ``py-spy record`` (a sampling profiler,
in the bench extras' environment; absent, nothing is recorded) on an actor's process, its samples
folded into the functions that held the CPU most. How the harness tells a design cost (a function
whose share grows with N) from this machine's limit (Ray's and the interpreter's own frames)."""

from __future__ import annotations

import logging
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Samples per second: enough for a share of a few percent over a measured window.
RATE = 50
#: A frame of LayerCheck's own code (py-spy names files from their import root: ``(orchestrator/store/fs.py:12)``).
_OURS = re.compile(r"\((?:[^()]*/)?(?:orchestrator|policies|workers|bench|layercheck)/[^()]*\.py:\d+\)")


class Recording:
    """``py-spy record`` on ``pid`` into ``out`` (raw folded stacks) until :meth:`stop`."""

    def __init__(self, pid: int, out: Path) -> None:
        self.out = out
        beside = Path(sys.executable).parent / "py-spy"  # (a virtual environment's, not on PATH when run by path)
        exe = shutil.which("py-spy") or (str(beside) if beside.exists() else None)
        self.proc = (
            subprocess.Popen(
                [
                    exe,
                    "record",
                    "--pid",
                    str(pid),
                    "--rate",
                    str(RATE),
                    "--format",
                    "raw",
                    "--output",
                    str(out),
                    "--nonblocking",
                    "--gil",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if exe
            else None
        )

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)  # py-spy writes its file as it ends
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def record(pids: dict[str, int], out_dir: Path, label: str) -> list[tuple[str, Recording]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [(name, Recording(pid, out_dir / f"{label}-{name}.txt")) for name, pid in pids.items()]


def top_functions(out: Path, most: int = 8) -> list[tuple[str, float]]:
    """The functions whose own samples (the stack's innermost frame that is not Ray's or the
    interpreter's) were the largest shares of a recording, with their shares."""
    if not out.exists():
        return []
    own: Counter[str] = Counter()
    total = 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        ours = [f for f in frames if _OURS.search(f)]
        key = _short(ours[-1]) if ours else f"(outside LayerCheck) {_short(frames[-1])}"
        own[key] += int(count)
        total += int(count)
    return [(name, n / total) for name, n in own.most_common(most)] if total else []


def _short(frame: str) -> str:
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1].rstrip(')')})" if where else name


def summarize(recordings: list[tuple[str, Recording]]) -> dict[str, Any]:
    out = {}
    for name, recording in recordings:
        recording.stop()
        out[name] = [{"function": f, "share": round(share, 3)} for f, share in top_functions(recording.out)]
    return out
