"""Run a worker script in N real processes with the deepspeed launcher (CPU: gloo), as one node or as several nodes on
this machine, and return its output."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
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


def deepspeed_launch_nodes(
    script: str | Path,
    nodes: int,
    procs_per_node: int,
    args: list[str],
    node_args=lambda node: [],
    timeout: int = 600,
) -> list[str]:
    """Launch ``script`` as ``nodes`` nodes of ``procs_per_node`` processes on this machine, the way a cluster without
    ssh between its nodes is launched: a hostfile names the nodes, and every node runs ``deepspeed --hostfile H
    --no_ssh --node_rank i --master_addr <node 0> --master_port P``.  ``node_args(i)`` adds node i's own flags.
    Returns each node's output; raises with every node's output tail when one fails."""
    launcher = Path(sys.executable).parent / "deepspeed"
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), WANDB_MODE="offline", PYTHONWARNINGS="ignore")
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hostfile"
        hostfile.write_text("".join(f"node{i} slots={procs_per_node}\n" for i in range(nodes)))
        common = [str(launcher), "--hostfile", str(hostfile), "--no_ssh", "--master_addr", "127.0.0.1"]
        common += ["--master_port", str(port)]
        logs = [Path(tmp) / f"node{i}.log" for i in range(nodes)]  # files, not pipes: no node blocks on a full pipe
        procs = []
        for i in range(nodes):
            with open(logs[i], "w") as log:
                procs.append(
                    subprocess.Popen(
                        [*common, "--node_rank", str(i), str(script), *args, *node_args(i)],
                        cwd=ROOT,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # a node's launcher and its processes end together on a timeout
                    )
                )
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        outputs = [log.read_text() for log in logs]
    leaked = shm_buffers(port)
    for f in leaked:
        f.unlink(missing_ok=True)
    failed = [i for i, proc in enumerate(procs) if proc.returncode != 0]
    if failed:
        tails = "\n".join(f"--- node {i} ({procs[i].returncode}):\n{out[-4000:]}" for i, out in enumerate(outputs))
        raise AssertionError(f"node(s) {failed} of {script} failed:\n{tails}")
    if leaked:
        raise AssertionError(f"the run left DeepSpeed shared-memory buffers behind: {[f.name for f in leaked]}")
    return outputs


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
