"""Running one script in several processes of one gloo group on this machine (tests of sharded and synced code)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

LEAVE = """
dist.barrier()  # no rank tears the group down while another still talks to it
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # no interpreter finalization: gloo's threads winding down can abort it (SIGABRT, seen in CI)
"""
"""The end of a rank script (which imports ``os``, ``sys`` and ``torch.distributed as dist``): append it."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(script: Path, world: int, args: list[str], timeout: int = 240) -> None:
    """Runs ``script`` in ``world`` processes of one gloo group; fails with their output if any fails."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    env["WORLD_SIZE"] = str(world)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outputs.append((p.returncode, out))
    failed = [(r, code, out[-4000:]) for r, (code, out) in enumerate(outputs) if code != 0]
    assert not failed, failed
