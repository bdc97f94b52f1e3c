"""The tuner's empirical mode (``--empirical``): short real runs of the top analytic candidates within a time budget,
a refit of the time model to their step times and a final ranking from both (docs/tuner.md, "Empirical mode"); the
session's rules are the core's (``core.session``).  Standard library only."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from ds_megatron.config import ConfigError
from ds_megatron.tune.core import session
from ds_megatron.tune.core.calibration import FIT_TERMS
from ds_megatron.tune.core.session import resolve_device  # by name: the command line and fakes reach it here
from ds_megatron.tune.training.calibration import Measurement, fit_time_model
from ds_megatron.tune.training.probe import EmpiricalOptions, ProbeResult, probe
from ds_megatron.tune.training.report import cells
from ds_megatron.tune.training.search import Evaluation, SearchResult, search


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
        return self.outcome.status if self.outcome else session.NOT_RUN

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
            "reason": o.reason if o else session.NOT_RUN_REASON,
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
class EmpiricalResult(session.Session):
    processes: int = 0  # launched per run (the --gpus of the problem)
    spearman_before: float | None = None  # predicted (analytic) vs measured step time
    spearman_after: float | None = None  # predicted (recalibrated) vs measured

    @property
    def measured(self) -> list[ProbeRun]:
        return [r for r in self.runs if r.measured_s is not None]

    @property
    def winner(self) -> FinalEntry | None:
        return self.final[0] if self.final else None

    def as_dict(self, top: int = 10) -> dict:
        o = self.options
        correlations = {
            "spearman_predicted_vs_measured": self.spearman_before,
            "spearman_calibrated_vs_measured": self.spearman_after,
        }
        return {
            "device": o.device,
            "processes": self.processes,
            "warmup_steps": o.warmup,
            "measured_steps": o.steps,
            **self.budget_dict(),
            "peak_mem_note": PEAK_MEM_NOTE[o.device],
            "runs": [r.as_dict() for r in self.runs],
            "not_run": self.not_run,
            **self.outcome_dict(top, correlations, self.winner),
        }


PEAK_MEM_NOTE = {
    "cpu": "peak_mem_gb is the max RSS of the logging process (last stage, dp 0, tp 0), not a stage's device memory",
    "gpu": "peak_mem_gb is torch.cuda.max_memory_allocated of the logging process (last stage, dp 0, tp 0)",
}


def validate_options(result: SearchResult, options: EmpiricalOptions) -> None:
    counts = (("--empirical-top", options.top, 1), ("--empirical-steps", options.steps, 1))
    session.check_budget(options.max_minutes, (*counts, ("--empirical-warmup", options.warmup, 0)))
    session.check_one_node(result.cluster.num_gpus, result.cluster.gpus_per_node)
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
    options = dataclasses.replace(options, device=device, work_dir=str(session.work_dir(options.work_dir)))
    picked = chosen if chosen is not None else top_candidates(result.ranked, options.top, device)
    rank = {e.candidate: i + 1 for i, e in enumerate(result.ranked)}
    runs = [ProbeRun(i + 1, rank[e.candidate], e, e.time.step_s) for i, e in enumerate(picked)]
    emp = EmpiricalResult(options, max(0.0, deadline - start), runs, processes=procs)
    kind = f"{procs} CPU process(es) (gloo, fp32)" if device == "cpu" else f"{procs} GPU(s) (bf16, ZeRO-1)"
    say(
        f"empirical: measuring {len(runs)} candidate(s) on {kind}, {options.warmup} warm-up + {options.steps}"
        f" measured steps each, {emp.budget_s / 60:.1f} min budget; runs in {options.work_dir}"
    )
    budget = session.Budget(deadline)
    for pos, run in enumerate(runs):
        timeout, remaining = budget.next_timeout(len(runs) - pos)
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
            budget.durations.append(o.duration_s)
            say(
                f"      ok in {o.duration_s:.0f} s: {o.step_s:.3f} s/step measured (median of {len(o.step_times_s)}),"
                f" {run.predicted_s:.3f} predicted; peak {o.peak_mem_gb or 0:.2f} GB"
            )
        else:
            say(f"      {o.status} after {o.duration_s:.0f} s: {o.reason} (log: {o.run_dir}/output.log)")
    recalibrate(result, emp)
    emp.elapsed_s = budget.elapsed_s(options.max_minutes)
    return emp


def recalibrate(result: SearchResult, emp: EmpiricalResult) -> None:
    """Fit the time model to the measured runs, re-rank every candidate, build the final ranking."""
    measured = emp.measured
    emp.spearman_before = session.spearman([r.predicted_s for r in measured], [r.measured_s for r in measured])
    points = [
        Measurement(result.model, result.cluster, r.evaluation.candidate, result.global_batch_size, r.measured_s)
        for r in measured
    ]
    terms = FIT_TERMS if emp.options.device == "cpu" else ()
    emp.calibration, emp.calibration_note = session.fit_or_keep(
        measured, lambda: fit_time_model(points, extra_terms=terms)
    )
    cluster = emp.calibration.apply(result.cluster) if emp.calibration else result.cluster
    emp.recalibrated = search(result.model, cluster, result.global_batch_size, result.pins)
    again = {e.candidate: e.time.step_s for e in emp.recalibrated.ranked}
    for r in emp.runs:
        r.calibrated_s = again.get(r.evaluation.candidate)
    emp.spearman_after = session.spearman([r.calibrated_s for r in measured], [r.measured_s for r in measured])
    emp.final = final_ranking(emp.recalibrated.ranked, emp.runs)


def final_ranking(ranked: list[Evaluation], runs: list[ProbeRun]) -> list[FinalEntry]:
    """Measured step time where a run measured one, recalibrated prediction otherwise; failed runs left out."""
    measured = {r.evaluation.candidate: r.measured_s for r in runs if r.measured_s is not None}
    failed = {r.evaluation.candidate for r in runs if r.outcome is not None and r.measured_s is None}
    step = lambda e: e.time.step_s  # noqa: E731
    entries = [
        FinalEntry(*x) for x in session.measured_or_predicted(ranked, lambda e: e.candidate, measured, failed, step)
    ]
    # Measured first among equals: a measurement beats a prediction of the same time.
    entries.sort(key=lambda f: (f.step_s, f.source != "measured", f.evaluation.required_bytes))
    return entries
