"""A description of the machine a benchmark ran on (for the committed results)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib import metadata
from typing import Any


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _virtualized() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return any(line.startswith("flags") and " hypervisor" in line for line in f)
    except OSError:
        return False


def _memory() -> str:
    try:
        out = subprocess.run(["free", "-h"], capture_output=True, text=True, timeout=5, check=True).stdout
        return " ".join(out.splitlines()[1].split()[1:2]) + " total (free -h)"
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def describe() -> dict[str, Any]:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    load = os.getloadavg() if hasattr(os, "getloadavg") else ()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "cpu": _cpu_model() + (" (virtual machine)" if _virtualized() else ""),
        "memory": _memory(),
        "gpu": gpu,
        "load_average_at_start": ", ".join(f"{x:.1f}" for x in load),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "deepspeed": _version("deepspeed"),
        "transformers": _version("transformers"),
        "pyarrow": _version("pyarrow"),
    }
