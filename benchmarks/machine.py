"""What the benchmark scripts report about the machine they ran on: its CPU and software, and their process's memory.

The scripts put their own folder on ``sys.path`` before importing this module, so it is found both when they run as
``python benchmarks/<script>.py`` and when a test loads them from their file.
"""

from __future__ import annotations

import importlib
import os
import platform


def proc_status(field: str) -> int:
    """A memory figure of this process from ``/proc/self/status`` (Linux), in bytes: ``VmRSS``, ``VmHWM``, ...

    Example:
        >>> proc_status("VmRSS") > 0
        True
    """
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def describe(*packages: str) -> str:
    """CPU model, cores, and the versions of Python, torch and ``packages``.

    Example:
        >>> "torch" in describe("lightning")
        True
    """
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = ", ".join(f"{name} {importlib.import_module(name).__version__}" for name in ("torch", *packages))
    return f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, {versions}"
