"""The inference empirical mode's measuring launches: what one launch of ``recipes/measure_inference.py`` measures
(``launch_tps``), its plan, and each candidate's outcome read back from its JSON lines, also after a time-out or a
crash (docs/tuner.md, "Inference: empirical mode").  Standard library only: the measuring run is a subprocess."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ds_megatron.config import ConfigError
from ds_megatron.tune.core import launch
from ds_megatron.tune.core.launch import run_process  # by name: a fake launch replaces it here
from ds_megatron.tune.core.session import NOT_RUN, NOT_RUN_REASON
from ds_megatron.tune.inference.model import (
    InferenceEvaluation,
    InferenceResult,
    Serving,
    Workload,
    output_tokens_per_s,
)

MEASURE_RECIPE = launch.RECIPES / "measure_inference.py"
PROBE_DTYPES = ("fp32", "bf16", "fp16")  # what the measuring run loads a transformers model at


@dataclass(frozen=True)
class InferenceEmpiricalOptions:
    """The ``--empirical*`` flags of ``inference``."""

    max_minutes: float  # wall-clock budget of the whole command
    top: int = 6  # candidates to measure (pp 1 only: the measuring run has no pipeline)
    repeats: int = 3  # measured requests per candidate (--empirical-steps)
    warmup: int = 1  # requests dropped first (--empirical-warmup)
    device: str = "auto"  # "auto" | "cpu" | "gpu"; resolved before the first launch
    work_dir: str | None = None  # one sub-directory per launch (default runs/tune/<date-time>)


@dataclass(frozen=True)
class Figures:
    """TTFT, TPOT and the output tokens/s over every replica they give (predicted or measured)."""

    ttft: float
    tpot: float
    tokens_per_s: float


@dataclass
class InferenceRun:
    """One candidate: its analytic prediction, what its measuring run gave, its recalibrated prediction."""

    index: int  # measuring order, 1-based
    rank: int  # analytic rank
    evaluation: InferenceEvaluation
    status: str = NOT_RUN  # "ok" | "out of memory" | "failed" | "timeout" | "not run"
    reason: str | None = NOT_RUN_REASON
    measured: Figures | None = None
    ttfts_s: list[float] = field(default_factory=list)  # the measured prefills
    decode_steps: int = 0  # decode steps averaged into the TPOT
    peak_mem_gb: float | None = None
    launch: str | None = None  # the launch's directory
    calibrated: Figures | None = None

    @property
    def predicted(self) -> Figures:
        return figures_of(self.evaluation)

    def as_dict(self) -> dict:
        pick = lambda f: dataclasses.asdict(f) if f else None  # noqa: E731
        return {
            "index": self.index,
            "analytic_rank": self.rank,
            **dataclasses.asdict(self.evaluation.serving),
            "status": self.status,
            "reason": self.reason,
            "predicted": pick(self.predicted),
            "calibrated": pick(self.calibrated),
            "measured": pick(self.measured),
            "measured_ttfts_s": self.ttfts_s,
            "decode_steps": self.decode_steps,
            "peak_mem_gb": self.peak_mem_gb,
            "launch_dir": self.launch,
        }


@dataclass(frozen=True)
class Launch:
    """One measuring launch: the candidates of the tps it holds (``launch_tps``), in one process group."""

    world_size: int
    indices: tuple[int, ...]
    run_dir: str
    command: list[str]
    returncode: int | None  # None: killed at its timeout
    duration_s: float
    timeout_s: float


def figures_of(e: InferenceEvaluation) -> Figures:
    return Figures(e.time.ttft_s, e.time.tpot_s, e.tokens_per_s)


def measured_figures(serving: Serving, work: Workload, ttft_s: float, tpot_s: float) -> Figures:
    return Figures(ttft_s, tpot_s, output_tokens_per_s(serving, work.output_length, ttft_s, tpot_s))


def launch_tps(world: int) -> tuple[int, ...]:
    """The tensor-parallel sizes one launch of ``world`` processes measures: tp = world, the model over every rank,
    and tp 1 on rank 0 while the others wait.  A tp in between needs a launch of its own: DeepSpeed builds its
    inference TP group over ranks 0..tp-1 once per process (``InferenceEngine.inference_mp_group``, a class
    attribute), inside ``init_inference``, which only the model's ranks call, while torch wants every rank in
    ``new_group``."""
    return (1, world)


def launch_groups(tps: list[int]) -> list[tuple[int, ...]]:
    """The launches that measure ``tps``, each a tuple of the tps it holds (its world size the largest), in order:
    the largest tp shares its launch with tp 1 (``launch_tps``); every other tp has one of its own."""
    wanted = sorted(set(tps))
    if not wanted:
        return []
    shared = tuple(t for t in dict.fromkeys(launch_tps(wanted[-1])) if t in wanted)
    return sorted({shared, *((t,) for t in wanted if t not in shared)})


def measure_launch(
    result: InferenceResult,
    hf_dir: str,
    options: InferenceEmpiricalOptions,
    world: int,
    runs: list[InferenceRun],
    number: int,
    timeout_s: float,
) -> Launch:
    """One launch of ``recipes/measure_inference.py`` on ``world`` processes for ``runs`` (their tps: ``launch_tps``);
    records each run's outcome and never raises for a failed launch."""
    if not MEASURE_RECIPE.exists():
        raise ConfigError(
            "--empirical", "the measuring recipe is missing", str(MEASURE_RECIPE), "run from a ds_megatron checkout"
        )
    tps = "-".join(str(t) for t in dict.fromkeys(r.evaluation.serving.tp for r in runs))
    run_dir = Path(options.work_dir) / f"{number:02d}-tp{tps}"
    run_dir.mkdir(parents=True, exist_ok=True)
    plan = launch_plan(result, hf_dir, options, runs)
    (run_dir / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    out = run_dir / "results.jsonl"
    out.unlink(missing_ok=True)
    cmd = [*launch.launch_command(world, MEASURE_RECIPE), "--plan", str(run_dir / "plan.json"), "--out", str(out)]
    log = run_dir / "output.log"
    returncode, duration = run_process(cmd, log, timeout_s, launch.probe_env(options.device, world))
    record_outcomes(runs, out, returncode, launch.log_tail(log), timeout_s, result.workload)
    for r in runs:
        if r.status != NOT_RUN:
            r.launch = str(run_dir)
    return Launch(world, tuple(r.index for r in runs), str(run_dir), cmd, returncode, duration, timeout_s)


def launch_plan(
    result: InferenceResult, hf_dir: str, options: InferenceEmpiricalOptions, runs: list[InferenceRun]
) -> dict:
    """What the measuring run reads (ds_megatron/cli/measure_inference.py documents the keys)."""
    w = result.workload
    return {
        "hf_dir": str(Path(hf_dir).resolve()),
        "prompt_length": w.prompt_length,
        "output_length": w.output_length,
        "dtype": w.weight_dtype,
        "warmup": options.warmup,
        "repeats": options.repeats,
        "candidates": [
            {"index": r.index, "tp": r.evaluation.serving.tp, "batch": r.evaluation.serving.batch} for r in runs
        ],
    }


def read_results(path: Path) -> tuple[list[int], dict[int, dict], int | None]:
    """(indices started, in order; index -> its result record; the tp whose model was being built when the file
    ends, else None) from a measuring run's JSON lines."""
    started, results, building = [], {}, None
    for record in launch.json_lines(path):
        event = record.get("event")
        building = record["tp"] if event == "build" else None
        if event == "start":
            started.append(record["index"])
        elif event == "result":
            results[record["index"]] = record
    return started, results, building


def record_outcomes(
    runs: list[InferenceRun], out: Path, returncode: int | None, log_tail: str, timeout_s: float, work: Workload
) -> None:
    """Each run's outcome: its result line where it has one.  When the launch timed out or crashed, the candidate of
    the last request started is the one it was in, or, when it was loading a tp's model, every candidate of that tp
    (the reason from the exit status and the log); the others had their requests cut short or never started and stay
    "not run" (a new launch may measure them); a launch that failed before any event fails every candidate."""
    started, results, building = read_results(out)
    culprit = started[-1] if building is None and started and started[-1] not in results else None
    nothing = not started and not results and building is None  # the launch failed before its first event
    for r in runs:
        rec = results.get(r.index)
        if rec is not None and rec["status"] == "ok" and rec.get("tpot_s"):
            r.status, r.reason = "ok", None
            r.measured = measured_figures(r.evaluation.serving, work, rec["ttft_s"], rec["tpot_s"])
            r.ttfts_s, r.decode_steps, r.peak_mem_gb = rec["ttfts_s"], rec["decode_steps"], rec.get("peak_mem_gb")
        elif rec is not None:
            r.status = rec["status"] if rec["status"] != "ok" else "failed"
            r.reason = rec.get("reason") or "no decode step measured"
        elif returncode == 0 and r.index in started:
            r.status, r.reason = "failed", "the measuring run exited 0 without its result"
        elif returncode != 0 and (r.index == culprit or r.evaluation.serving.tp == building or nothing):
            status, reason = launch.failure_reason(returncode, log_tail, timeout_s)
            if r.evaluation.serving.tp == building:
                reason = f"loading the model at tp {building}: {reason}"
            elif r.index != culprit:
                reason = f"launch failed before it: {reason}"
            r.status, r.reason = status, reason
