"""The empirical mode's probe: run one candidate for a few real steps with ``recipes/train_gpt.py`` (the tuner's
config adapted to a short run, launched in its own process group) and read its step times from ``metrics.jsonl``
(docs/tuner.md, "How a run is made and measured").  Standard library only: the recipe runs in subprocesses."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ds_megatron.config import ConfigError
from ds_megatron.tune.search import Evaluation, SearchResult
from ds_megatron.tune.written import ds_config

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "train_gpt.py"
OOM_PATTERNS = re.compile(r"out of memory|OutOfMemoryError|MemoryError|Cannot allocate memory", re.IGNORECASE)
ERROR_LINE = re.compile(r"^error: ")  # ds_megatron's one-line configuration errors
EXCEPTION_LINE = re.compile(r"^\s*(\w+\.)*\w*(Error|Exception|Interrupt)\b")
LAUNCHER_LINE = re.compile(r"\[(launch|runner)\.py:\d+")  # deepspeed launcher bookkeeping, not the cause
MAX_REASON_CHARS = 300


@dataclass(frozen=True)
class EmpiricalOptions:
    """The ``--empirical*`` flags: the session's budget and how every candidate of it runs."""

    max_minutes: float  # wall-clock budget of the whole command
    top: int = 3  # candidates to measure
    steps: int = 10  # measured steps per run: their median is the measurement
    warmup: int = 3  # dropped: the first steps include allocation, graph building, communicator set-up
    device: str = "auto"  # "auto" | "cpu" | "gpu"; run_empirical resolves auto before the first probe
    work_dir: str | None = None  # one sub-directory per candidate (default runs/tune/<date-time>)
    extra_sets: tuple[str, ...] = ()  # more --set KEY=VALUE for every run (data, tokenizer, ...)


@dataclass
class ProbeResult:
    """What one run gave: a median step time, or why it has none."""

    status: str  # "ok" | "failed" | "out of memory" | "timeout"
    reason: str | None  # None when ok
    step_s: float | None  # median step time over the measured steps
    step_times_s: list[float] = field(default_factory=list)  # the measured steps, in order
    peak_mem_gb: float | None = None  # the logging process's peak (CPU: max RSS; GPU: max allocated)
    duration_s: float = 0.0  # wall time of the launch, start-up included
    run_dir: str = ""
    command: list[str] = field(default_factory=list)
    returncode: int | None = None  # None after a timeout


def run_slug(index: int, e: Evaluation) -> str:
    """A directory name for a candidate: ``03-tp2-pp2-dp1-sp-b4-selective`` (``-sdpa`` with that kernel;
    ``selective-mlp_act-layernorm`` for selective[mlp_act,layernorm])."""
    c = e.candidate
    sp = "-sp" if c.sequence_parallel else ""
    kernel = "-sdpa" if c.attention == "sdpa" else ""
    label = re.sub(r"[^A-Za-z0-9_]+", "-", c.recompute_label()).strip("-")  # selective[mlp_act,layernorm] -> ...
    return f"{index:02d}-tp{c.tp}-pp{c.pp}-dp{c.dp}{sp}-b{c.micro_batch_size}-{label}{kernel}"


def split_sets(options: EmpiricalOptions) -> tuple[Path, list[str]]:
    """(the data cache directory, which goes into every run's config; the other ``--set`` items)."""
    sets = dict(item.split("=", 1) for item in options.extra_sets)
    cache = Path(sets.pop("ds_megatron.data.cache_dir", ".cache/ds_megatron")).resolve()  # the recipe's default
    return cache, [f"{k}={v}" for k, v in sets.items()]


def probe_config(result: SearchResult, e: Evaluation, options: EmpiricalOptions, run_dir: Path) -> dict:
    """The tuner's config for ``e`` (written.ds_config), adapted to a short measuring run."""
    cfg = ds_config(result, e)
    if options.device == "cpu":  # the recipe's CPU path: fp32, no ZeRO (gloo has no bf16 kernels worth timing)
        for key in ("bf16", "data_types", "zero_optimization"):
            cfg.pop(key, None)
    section = cfg["ds_megatron"]
    section["train"] = dict(
        train_iters=options.warmup + options.steps, log_interval=1, eval_interval=0, eval_iters=1, generate_tokens=0
    )
    section["data"] = {"cache_dir": str(split_sets(options)[0])}
    section["logging"] = {"wandb_project": None, "run_dir": str(run_dir)}
    return cfg


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


GROUP_GONE_S = 30.0  # how long a SIGKILLed process group may take to leave the process table


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


def read_metrics(path: Path, warmup_steps: int) -> tuple[list[float], float | None]:
    """(step times in s after the warm-up, in step order; the largest peak_mem_gb) from a metrics.jsonl."""
    if not path.exists():
        return [], None
    times: dict[int, float] = {}
    peak = None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if "step_ms" not in record:
            continue  # validation or sample records
        if record["step"] > warmup_steps:
            times[record["step"]] = record["step_ms"] / 1000.0
        if record.get("peak_mem_gb") is not None:
            peak = max(peak or 0.0, record["peak_mem_gb"])
    return [times[s] for s in sorted(times)], peak


def probe(result: SearchResult, e: Evaluation, index: int, options: EmpiricalOptions, timeout_s: float) -> ProbeResult:
    """Launch candidate ``e`` for warm-up + measured steps and measure it; never raises for a failed run.
    ``options.device`` is resolved ("cpu" | "gpu") and ``options.work_dir`` set."""
    if not RECIPE.exists():
        raise ConfigError(
            "--empirical", "the training recipe is missing", str(RECIPE), "run the tuner from a ds_megatron checkout"
        )
    run_dir = (Path(options.work_dir) / run_slug(index, e)).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # the recipe appends; a stale file would mix runs
    config_path = run_dir / "ds_config.json"
    config_path.write_text(json.dumps(probe_config(result, e, options, run_dir), indent=2) + "\n")
    num_gpus = result.cluster.num_gpus
    cmd = [*launcher(), "--num_gpus", str(num_gpus), "--master_port", str(free_port())]
    cmd += [str(RECIPE), "--deepspeed_config", str(config_path)]
    cmd += [arg for item in split_sets(options)[1] for arg in ("--set", item)]
    log_path = run_dir / "output.log"
    returncode, duration = run_process(cmd, log_path, timeout_s, probe_env(options.device, num_gpus))
    times, peak = read_metrics(metrics, options.warmup)
    if returncode != 0:
        status, reason = failure_reason(returncode, log_path.read_text(errors="replace")[-20000:], timeout_s)
    elif len(times) < options.steps:
        status, reason = "failed", f"exit 0 but only {len(times)} of {options.steps} measured steps in {metrics}"
    else:
        status, reason = "ok", None
    step_s = statistics.median(times) if status == "ok" else None
    return ProbeResult(status, reason, step_s, times, peak, duration, str(run_dir), cmd, returncode)
