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


TINY_CONFIG = str(ROOT / "ds_configs" / "gpt_tiny.json")
RECIPE = ROOT / "recipes" / "train_gpt.py"


def quiet_run_flags(tmp_path: Path, name: str, tp: int, pp: int, dropout: float | None = None) -> list[str]:
    """Flags for short test runs of the recipe: own run dir, shared data cache, a log line per step, no sample,
    no wandb, one validation batch."""
    flags = [
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--log-interval",
        "1",
        "--set",
        f"ds_megatron.logging.run_dir={tmp_path / name}",
        "--set",
        f"ds_megatron.data.cache_dir={tmp_path / 'cache'}",
        "--set",
        "ds_megatron.train.generate_tokens=0",
        "--set",
        "ds_megatron.logging.wandb_project=null",
        "--set",
        "ds_megatron.train.eval_iters=1",
    ]
    if dropout is not None:
        flags += ["--set", f"ds_megatron.model.dropout={dropout}"]
    return flags


def read_records(run_dir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_losses(run_dir: Path) -> dict[int, float]:
    """Per-step training loss from a run's metrics.jsonl."""
    return {r["step"]: r["loss"] for r in read_records(run_dir) if "loss" in r}
