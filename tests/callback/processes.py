"""Running a training script as its own process group of one launcher: a free local port, a clean environment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


LEAVE = """\
import os
import sys
import traceback

try:  # (not runpy.run_path, which sets sys.argv[0] to the script: Lightning would start the other ranks on it)
    with open({script!r}) as file:
        exec(compile(file.read(), {script!r}, "exec"), {{"__name__": "__main__", "__file__": {script!r}}})
except SystemExit as stop:
    if stop.code not in (None, 0):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(stop.code if isinstance(stop.code, int) else 1)
except BaseException:
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
import torch.distributed as dist

if dist.is_available() and dist.is_initialized():
    dist.barrier()  # no rank tears the group down while another still talks to it
    dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # no interpreter finalization: gloo's threads winding down can abort it (SIGABRT, seen in CI)
"""
"""The launcher of a rank script: runs it, then leaves as :data:`ranks.LEAVE` does. Lightning starts the other ranks
with this process's ``sys.argv``, so they run through it too."""


def run_script(script: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """Run ``script`` with ``args`` in a fresh interpreter set up for torch.distributed on this machine (one thread,
    warnings off, no rank variables inherited from the test process), every rank through :data:`LEAVE`; fails the
    test on a non-zero exit."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK"):
        env.pop(name, None)
    launcher = script.with_name(f"{script.stem}_leave.py")
    launcher.write_text(LEAVE.format(script=str(script)))
    done = subprocess.run(
        [sys.executable, str(launcher), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done
