"""Run a worker script in N real processes with the deepspeed launcher (CPU: gloo) and return its output."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_buffers(port: int) -> list[Path]:
    """DeepSpeed's CPU all-reduce buffers of the job that used ``port``."""
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def deepspeed_launch(
    script: str | Path, nprocs: int, args: list[str], timeout: int = 600, env_extra: dict | None = None
) -> str:
    """Launch ``script`` under ``deepspeed --num_gpus nprocs``; raise with the output tail on failure."""
    launcher = Path(sys.executable).parent / "deepspeed"
    port = _free_port()
    cmd = [str(launcher), "--num_gpus", str(nprocs), "--master_port", str(port), str(script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), WANDB_MODE="offline", PYTHONWARNINGS="ignore")
    env.update(env_extra or {})
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    leaked = shm_buffers(port)
    for f in leaked:  # never let a failed run fill the machine's memory (see engine.release_shm_buffer_name)
        f.unlink(missing_ok=True)
    if leaked and proc.returncode == 0:
        raise AssertionError(f"the run left DeepSpeed shared-memory buffers behind: {[f.name for f in leaked]}")
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed with {proc.returncode}:\n{output[-6000:]}")
    return output
