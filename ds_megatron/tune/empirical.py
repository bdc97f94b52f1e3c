"""The tuner's empirical mode (``--empirical``): short real runs of the top analytic candidates within a time budget,
a refit of the time model to their step times and a final ranking from both (docs/tuner.md, "Empirical mode").
Standard library only: ``--device auto`` asks torch about GPUs in a subprocess."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ds_megatron.config import ConfigError
from ds_megatron.tune.calibration import Calibration, Measurement, fit_time_model
from ds_megatron.tune.probe import EmpiricalOptions, ProbeResult, probe
from ds_megatron.tune.report import cells
from ds_megatron.tune.search import Evaluation, SearchResult, search
from ds_megatron.tune.time_model import FIT_TERMS

REPORT_RESERVE_S = 5.0  # kept back from the budget for the recalibrated search and the report
MIN_LAUNCH_S = 10.0  # no launch finishes faster (launcher, imports, process group, data): do not start one
FIRST_RUN_S = 120.0  # timeout floor before any run has finished (it builds the tokenizer/corpus cache)
HANG_FACTOR = 3.0  # later runs may take this many times the slowest finished run before they count as hung
DEVICES = ("auto", "cpu", "gpu")


@dataclass
class ProbeRun:
    """One candidate of the empirical phase: its analytic prediction, its run, its recalibrated prediction."""

    index: int  # launch order, 1-based
    rank: int  # analytic rank
    evaluation: Evaluation
    predicted_s: float  # analytic prediction, before calibration
    outcome: ProbeResult | None = None  # None: not run (budget)
    calibrated_s: float | None = None  # prediction of the recalibrated model

    @property
    def status(self) -> str:
        return self.outcome.status if self.outcome else "not run"

    @property
    def measured_s(self) -> float | None:
        return self.outcome.step_s if self.outcome else None

    def as_dict(self) -> dict:
        o = self.outcome
        return {
            "index": self.index,
            "analytic_rank": self.rank,
            **self.evaluation.candidate.settings(),
            "status": self.status,
            "reason": o.reason if o else "not run: the --max-minutes budget would be exceeded",
            "predicted_step_s": self.predicted_s,
            "calibrated_step_s": self.calibrated_s,
            "measured_step_s": self.measured_s,
            "measured_steps_s": o.step_times_s if o else [],
            **{k: getattr(o, k, None) for k in ("peak_mem_gb", "duration_s", "returncode", "run_dir", "command")},
        }


@dataclass(frozen=True)
class FinalEntry:
    """A candidate of the final ranking and where its step time comes from."""

    evaluation: Evaluation  # from the recalibrated search
    step_s: float
    source: str  # "measured" | "predicted"

    def as_dict(self) -> dict:
        return {**self.evaluation.candidate.settings(), "step_time_s": self.step_s, "source": self.source}


@dataclass
class EmpiricalResult:
    options: EmpiricalOptions  # device resolved ("cpu" | "gpu"), work_dir set
    processes: int  # launched per run (the --gpus of the problem)
    budget_s: float
    runs: list[ProbeRun]
    calibration: Calibration | None = None
    calibration_note: str = ""  # why there is no calibration, when there is none
    spearman_before: float | None = None  # predicted (analytic) vs measured step time
    spearman_after: float | None = None  # predicted (recalibrated) vs measured
    recalibrated: SearchResult | None = None
    final: list[FinalEntry] = field(default_factory=list)
    elapsed_s: float = 0.0  # since the command started (the budget's clock)

    @property
    def measured(self) -> list[ProbeRun]:
        return [r for r in self.runs if r.measured_s is not None]

    @property
    def winner(self) -> FinalEntry | None:
        return self.final[0] if self.final else None

    def as_dict(self, top: int = 10) -> dict:
        o, cal = self.options, self.calibration
        return {
            "device": o.device,
            "processes": self.processes,
            "warmup_steps": o.warmup,
            "measured_steps": o.steps,
            "max_minutes": o.max_minutes,
            "elapsed_s": self.elapsed_s,
            "work_dir": o.work_dir,
            "peak_mem_note": PEAK_MEM_NOTE[o.device],
            "runs": [r.as_dict() for r in self.runs],
            "not_run": [r.index for r in self.runs if r.outcome is None],
            "calibration": dataclasses.asdict(cal) if cal else None,
            "calibration_note": self.calibration_note,
            "spearman_predicted_vs_measured": self.spearman_before,
            "spearman_calibrated_vs_measured": self.spearman_after,
            "final_ranking": [f.as_dict() for f in self.final[:top]],
            "winner": self.winner.as_dict() if self.winner else None,
        }


PEAK_MEM_NOTE = {
    "cpu": "peak_mem_gb is the max RSS of the logging process (last stage, dp 0, tp 0), not a stage's device memory",
    "gpu": "peak_mem_gb is torch.cuda.max_memory_allocated of the logging process (last stage, dp 0, tp 0)",
}


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (Pearson's of the ranks); None for fewer than 2 points or a constant."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman: {len(xs)} x values but {len(ys)} y values")
    try:
        return statistics.correlation(_ranks(xs), _ranks(ys))
    except statistics.StatisticsError:  # fewer than 2 points, or a constant
        return None


def _ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their average: c equal values from sorted position i all rank i + (c + 1) / 2."""
    order = sorted(values)
    return [order.index(v) + (order.count(v) + 1) / 2 for v in values]


def plan_timeout(remaining_s: float, left: int, durations: list[float]) -> float | None:
    """Timeout of the next run, or None when it should not start (docs/tuner.md, "Budget").  ``remaining_s``: budget
    left after the report reserve; ``left``: runs to go (this one too); ``durations``: measured runs' wall times."""
    expected = statistics.median(durations) if durations else 0.0
    if remaining_s < max(MIN_LAUNCH_S, expected):
        return None
    floor = HANG_FACTOR * max(durations) if durations else FIRST_RUN_S
    return min(remaining_s, max(remaining_s / max(left, 1), floor))


@functools.cache  # asked once per process: the command line resolves it before the search, run_empirical again
def resolve_device(device: str, num_gpus: int) -> str:
    """``auto`` becomes ``gpu`` when torch (asked in a subprocess of this interpreter) sees a CUDA device, else ``cpu``;
    a GPU run needs enough devices."""
    if device not in DEVICES:
        raise ConfigError("--device", "unknown device", repr(device), f"use one of {', '.join(DEVICES)}")
    if device == "cpu":
        return "cpu"
    probe_cmd = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        proc = subprocess.run([sys.executable, "-c", probe_cmd], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise ConfigError("--device", "importing torch timed out", "300 s", "pass --device cpu or gpu") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError("--empirical", "cannot import torch to look for GPUs", last, "install torch and deepspeed")
    count = int(proc.stdout.strip().splitlines()[-1])
    if device == "auto" and count == 0:
        return "cpu"
    if count < num_gpus:
        raise ConfigError(
            "--device", "not enough GPUs on this machine", f"{count} visible, --gpus {num_gpus}", "lower --gpus"
        )
    return "gpu"


def validate_options(result: SearchResult, options: EmpiricalOptions) -> None:
    cl = result.cluster
    if not options.max_minutes > 0:
        raise ConfigError("--max-minutes", "must be positive", f"got {options.max_minutes}", "pass e.g. 10")
    for flag, value, least in (
        ("--empirical-top", options.top, 1),
        ("--empirical-steps", options.steps, 1),
        ("--empirical-warmup", options.warmup, 0),
    ):
        if value < least:
            raise ConfigError(flag, f"must be at least {least}", f"got {value}", f"pass e.g. {max(least, 3)}")
    if cl.num_gpus > cl.gpus_per_node:
        raise ConfigError(
            "--empirical",
            "runs on this machine only",
            f"gpus={cl.num_gpus} > gpus_per_node={cl.gpus_per_node}",
            "measure a one-node problem (--gpus <= --gpus-per-node) or drop --empirical",
        )
    for item in options.extra_sets:
        if "=" not in item:
            raise ConfigError("--empirical-set", "expected KEY=VALUE", repr(item), "e.g. ds_megatron.data.path=x.txt")


def top_candidates(ranked: list[Evaluation], top: int, device: str) -> list[Evaluation]:
    """The first ``top`` of the analytic ranking; on CPU only the better-ranked attention kernel of each configuration
    (there sdpa with dropout falls back to the eager kernel's work, so the other would measure the same again)."""
    if device != "cpu":
        return ranked[:top]
    first: dict = {}  # configuration (the kernel set to eager) -> its best-ranked evaluation
    for e in ranked:
        first.setdefault(dataclasses.replace(e.candidate, attention="eager"), e)
    return list(first.values())[:top]


def run_empirical(
    result: SearchResult,
    options: EmpiricalOptions,
    deadline: float,
    say: Callable[[str], None] = print,
    chosen: list[Evaluation] | None = None,
) -> EmpiricalResult:
    """Measure the top ``options.top`` candidates (or ``chosen``, in that order) before ``deadline``
    (a time.monotonic() value), recalibrate, re-rank."""
    validate_options(result, options)
    start = time.monotonic()
    procs = result.cluster.num_gpus
    device = resolve_device(options.device, procs)
    work_dir = str(Path(options.work_dir or f"runs/tune/{time.strftime('%Y%m%d-%H%M%S')}"))
    options = dataclasses.replace(options, device=device, work_dir=work_dir)
    picked = chosen if chosen is not None else top_candidates(result.ranked, options.top, device)
    rank = {e.candidate: i + 1 for i, e in enumerate(result.ranked)}
    runs = [ProbeRun(i + 1, rank[e.candidate], e, e.time.step_s) for i, e in enumerate(picked)]
    emp = EmpiricalResult(options, procs, max(0.0, deadline - start), runs)
    kind = f"{procs} CPU process(es) (gloo, fp32)" if device == "cpu" else f"{procs} GPU(s) (bf16, ZeRO-1)"
    say(
        f"empirical: measuring {len(runs)} candidate(s) on {kind}, {options.warmup} warm-up + {options.steps}"
        f" measured steps each, {emp.budget_s / 60:.1f} min budget; runs in {work_dir}"
    )
    durations: list[float] = []
    for pos, run in enumerate(runs):
        remaining = deadline - time.monotonic() - REPORT_RESERVE_S
        timeout = plan_timeout(remaining, len(runs) - pos, durations)
        if timeout is None:
            names = ", ".join(str(r.index) for r in runs[pos:])
            say(f"  budget: {max(remaining, 0):.0f} s left is too little for another run; not run: {names}")
            break
        short = "tp {tp}, pp {pp}, dp {dp}, SP {sp}, b {b} x {m}, {recompute}, {attn}".format(
            **cells(run.evaluation.candidate)
        )
        say(f"  [{run.index}/{len(runs)}] {short}: launching (timeout {timeout:.0f} s)")
        o = run.outcome = probe(result, run.evaluation, run.index, options, timeout)
        if o.step_s is not None:
            durations.append(o.duration_s)
            say(
                f"      ok in {o.duration_s:.0f} s: {o.step_s:.3f} s/step measured (median of {len(o.step_times_s)}),"
                f" {run.predicted_s:.3f} predicted; peak {o.peak_mem_gb or 0:.2f} GB"
            )
        else:
            say(f"      {o.status} after {o.duration_s:.0f} s: {o.reason} (log: {o.run_dir}/output.log)")
    recalibrate(result, emp)
    emp.elapsed_s = time.monotonic() - (deadline - 60 * options.max_minutes)  # of the whole command's budget
    return emp


def recalibrate(result: SearchResult, emp: EmpiricalResult) -> None:
    """Fit the time model to the measured runs, re-rank every candidate, build the final ranking."""
    measured = emp.measured
    emp.spearman_before = spearman([r.predicted_s for r in measured], [r.measured_s for r in measured])
    if not measured:
        emp.calibration_note = "no candidate was measured: the analytic model is kept"
    else:
        points = [
            Measurement(result.model, result.cluster, r.evaluation.candidate, result.global_batch_size, r.measured_s)
            for r in measured
        ]
        try:
            emp.calibration = fit_time_model(points, extra_terms=FIT_TERMS if emp.options.device == "cpu" else ())
        except ValueError as err:
            emp.calibration_note = f"calibration failed, the analytic model is kept: {err}"
    cluster = emp.calibration.apply(result.cluster) if emp.calibration else result.cluster
    emp.recalibrated = search(result.model, cluster, result.global_batch_size, result.pins)
    again = {e.candidate: e.time.step_s for e in emp.recalibrated.ranked}
    for r in emp.runs:
        r.calibrated_s = again.get(r.evaluation.candidate)
    emp.spearman_after = spearman([r.calibrated_s for r in measured], [r.measured_s for r in measured])
    emp.final = final_ranking(emp.recalibrated.ranked, emp.runs)


def final_ranking(ranked: list[Evaluation], runs: list[ProbeRun]) -> list[FinalEntry]:
    """Measured step time where a run measured one, recalibrated prediction otherwise; failed runs left out."""
    measured = {r.evaluation.candidate: r.measured_s for r in runs if r.measured_s is not None}
    failed = {r.evaluation.candidate for r in runs if r.outcome is not None and r.measured_s is None}
    entries = [
        FinalEntry(e, measured.get(e.candidate, e.time.step_s), "measured" if e.candidate in measured else "predicted")
        for e in ranked
        if e.candidate not in failed
    ]
    # Measured first among equals: a measurement beats a prediction of the same time.
    entries.sort(key=lambda f: (f.step_s, f.source != "measured", f.evaluation.required_bytes))
    return entries
