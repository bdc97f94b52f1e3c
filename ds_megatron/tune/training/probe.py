"""The empirical mode's probe: run one candidate for a few real steps with ``recipes/train_gpt.py`` (the tuner's
config adapted to a short run, launched in its own process group) and read its step times from ``metrics.jsonl``
(docs/tuner.md, "How a run is made and measured").  Standard library only: the recipe runs in subprocesses."""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ds_megatron.config import ConfigError
from ds_megatron.tune.core import launch
from ds_megatron.tune.training.search import Evaluation, SearchResult
from ds_megatron.tune.training.written import ds_config

RECIPE = launch.RECIPES / "train_gpt.py"


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


def read_metrics(path: Path, warmup_steps: int) -> tuple[list[float], float | None]:
    """(step times in s after the warm-up, in step order; the largest peak_mem_gb) from a metrics.jsonl."""
    times: dict[int, float] = {}
    peak = None
    for record in launch.json_lines(path):
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
    cmd = [*launch.launch_command(num_gpus, RECIPE), "--deepspeed_config", str(config_path)]
    cmd += [arg for item in split_sets(options)[1] for arg in ("--set", item)]
    log_path = run_dir / "output.log"
    returncode, duration = launch.run_process(cmd, log_path, timeout_s, launch.probe_env(options.device, num_gpus))
    times, peak = read_metrics(metrics, options.warmup)
    if returncode != 0:
        status, reason = launch.failure_reason(returncode, launch.log_tail(log_path), timeout_s)
    elif len(times) < options.steps:
        status, reason = "failed", f"exit 0 but only {len(times)} of {options.steps} measured steps in {metrics}"
    else:
        status, reason = "ok", None
    step_s = statistics.median(times) if status == "ok" else None
    return ProbeResult(status, reason, step_s, times, peak, duration, str(run_dir), cmd, returncode)
