"""The empirical modes' launches: the deepspeed launcher, a free master port, the environment, one launch in its own
process group killed afterwards (also on timeout or Ctrl-C), and why a launch gave no measurement (docs/tuner.md,
"How a run is made and measured").  Standard library only: the measuring recipes run in subprocesses."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

OOM_PATTERNS = re.compile(r"out of memory|OutOfMemoryError|MemoryError|Cannot allocate memory", re.IGNORECASE)
ERROR_LINE = re.compile(r"^error: ")  # ds_megatron's one-line configuration errors
EXCEPTION_LINE = re.compile(r"^\s*(\w+\.)*\w*(Error|Exception|Interrupt)\b")
LAUNCHER_LINE = re.compile(r"\[(launch|runner)\.py:\d+")  # deepspeed launcher bookkeeping, not the cause
RECIPES = Path(__file__).resolve().parents[3] / "recipes"  # the measuring recipes of this checkout
MAX_REASON_CHARS = 300
LOG_TAIL_CHARS = 20000  # of a launch's output, read for its failure reason
GROUP_GONE_S = 30.0  # how long a SIGKILLed process group may take to leave the process table


def launcher() -> list[str]:
    """The deepspeed launcher next to this interpreter, else on PATH, else its module."""
    local = Path(sys.executable).parent / "deepspeed"
    found = str(local) if local.exists() else shutil.which("deepspeed")
    return [found] if found else [sys.executable, "-m", "deepspeed.launcher.runner"]


def free_port() -> int:
    """A TCP port nobody listens on now (each launch gets its own master port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(num_processes: int, recipe: Path) -> list[str]:
    """The deepspeed launcher's command for ``recipe`` on ``num_processes`` processes of this machine."""
    return [*launcher(), "--num_gpus", str(num_processes), "--master_port", str(free_port()), str(recipe)]


def probe_env(device: str, num_gpus: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        # N processes share the cores: more threads than cores per process only thrash.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_gpus)))
    else:
        env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # TP communication and compute overlap in order
    return env


def run_process(cmd: list[str], log_path: Path, timeout_s: float, env: dict[str, str]) -> tuple[int | None, float]:
    """Run ``cmd`` in its own session with its output in ``log_path``; (exit status or None on timeout, seconds).
    The whole process group (the launcher and every rank) is killed afterwards, also on timeout or Ctrl-C."""
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode: int | None = proc.wait(timeout=max(timeout_s, 0.1))
        except subprocess.TimeoutExpired:
            returncode = None
        finally:  # also reaps ranks a failed launcher left behind
            with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already gone
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            wait_group_gone(proc.pid)
    return returncode, time.monotonic() - start


def wait_group_gone(pgid: int, timeout_s: float = GROUP_GONE_S) -> bool:
    """Wait until no live process of group ``pgid`` is left (True), or ``timeout_s`` passes (False).  After the
    group's SIGKILL the ranks, children of the launcher and not of this process, still run their exit (freeing their
    memory) for a while (a loaded machine took over a second): a caller that returned before that would report a
    killed run whose workers still hold memory and ports.  A zombie (exited, waiting for its new parent to reap it)
    holds neither and counts as gone."""
    deadline = time.monotonic() + timeout_s
    while _group_has_live_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _group_has_live_members(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):  # no member left (or none that could still be ours)
        return False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if int(group) == pgid and state != "Z":
                return True
    return False


def log_tail(log_path: Path) -> str:
    """The end of a launch's output, where its failure reason is."""
    return log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]


def json_lines(path: Path) -> Iterator[dict]:
    """The records of a JSON-lines file a launch appended to, skipping a line cut by a kill; none if it is missing."""
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill


def failure_reason(returncode: int | None, output: str, timeout_s: float) -> tuple[str, str]:
    """(status, reason) of a run that gave no measurement, from its exit status and the tail of its output."""
    if returncode is None:
        return "timeout", f"timeout after {timeout_s:.0f} s (process group killed)"
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    ours = [ln for ln in lines if not LAUNCHER_LINE.search(ln)]
    if oom := [ln for ln in ours if OOM_PATTERNS.search(ln)]:
        return "out of memory", f"out of memory (exit {returncode}): {_clip(oom[-1])}"
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return "failed", f"exit {returncode}: killed by SIGKILL (out of host memory?)"
    telling = (  # the most telling line first: ds_megatron's error line, an exception, any error, the last line
        [ln for ln in lines if ERROR_LINE.search(ln)],
        [ln for ln in lines if EXCEPTION_LINE.search(ln)],
        [ln for ln in ours if "error" in ln.lower()],
        lines,
    )
    last = next((found[-1] for found in telling if found), "no output")
    return "failed", f"exit {returncode}: {_clip(last)}"


def _clip(line: str) -> str:
    return line if len(line) <= MAX_REASON_CHARS else line[: MAX_REASON_CHARS - 3] + "..."
