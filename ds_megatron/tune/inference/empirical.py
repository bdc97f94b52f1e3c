"""The inference tuner's empirical mode (``inference --empirical``): short measured runs of the top analytic
candidates on this machine (TTFT and TPOT of the exported model under DeepSpeed's inference engine with AutoTP,
``recipes/measure_inference.py``), a refit of the inference model to them and a final ranking from both
(docs/tuner.md, "Inference: empirical mode").  Standard library only: the measuring runs are subprocesses."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ds_megatron.config import ConfigError
from ds_megatron.model import family_of
from ds_megatron.tune.core import session
from ds_megatron.tune.core.calibration import FIT_TERMS, Calibration, fit_parts
from ds_megatron.tune.core.spec import Cluster
from ds_megatron.tune.inference.model import (
    InferenceEvaluation,
    InferenceResult,
    Serving,
    inference_time,
    meets_limits,
    rank_key,
    search_inference,
)
from ds_megatron.tune.inference.probe import (
    PROBE_DTYPES,
    Figures,
    InferenceEmpiricalOptions,
    InferenceRun,
    Launch,
    figures_of,
    launch_groups,
    measure_launch,
)

FIGURES = ("tpot", "ttft", "tokens_per_s")  # compared between the model and the runs, as Figures attributes

REPLICAS_NOTE = (
    "one replica is measured per candidate; its replicas are independent copies on other GPUs, so the measured "
    "tokens/s is the replica's times the replica count"
)


@dataclass(frozen=True)
class FinalEntry:
    evaluation: InferenceEvaluation  # from the recalibrated search
    figures: Figures
    source: str  # "measured" | "predicted"

    def as_dict(self) -> dict:
        return {
            **dataclasses.asdict(self.evaluation.serving),
            **dataclasses.asdict(self.figures),
            "source": self.source,
        }


@dataclass
class InferenceEmpiricalResult(session.Session):
    launches: list[Launch] = field(default_factory=list)
    spearman: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)  # figure: (before, after)

    @property
    def ok(self) -> list[InferenceRun]:
        return [r for r in self.runs if r.measured is not None]

    @property
    def winner(self) -> FinalEntry | None:
        """The first of the final ranking when it meets the limits (the ranking puts those first)."""
        if not self.final or self.recalibrated is None:
            return None
        first, work = self.final[0], self.recalibrated.workload
        return first if meets_limits(work, first.figures.ttft, first.figures.tpot) else None

    def as_dict(self, top: int = 10) -> dict:
        o = self.options
        correlations = {"spearman": {k: {"analytic": b, "calibrated": a} for k, (b, a) in self.spearman.items()}}
        return {
            "device": o.device,
            "warmup_requests": o.warmup,
            "measured_requests": o.repeats,
            **self.budget_dict(),
            "replicas_note": REPLICAS_NOTE,
            "runs": [r.as_dict() for r in self.runs],
            "launches": [dataclasses.asdict(x) for x in self.launches],
            "not_run": self.not_run,
            **self.outcome_dict(top, correlations, self.winner),
        }


def validate_options(result: InferenceResult, options: InferenceEmpiricalOptions, hf_dir: str | None) -> None:
    """Refuse what the measuring runs cannot do, before anything is launched."""
    cl, work = result.cluster, result.workload
    counts = (("--empirical-top", options.top, 1), ("--empirical-steps", options.repeats, 1))
    session.check_budget(options.max_minutes, (*counts, ("--empirical-warmup", options.warmup, 0)))
    if result.model.num_experts:
        raise ConfigError(
            "--empirical", "the measuring run serves dense models only (its engine runs are not checked on experts)",
            f"{result.model.size or result.model.family} has {result.model.num_experts} experts",
            "drop --empirical: the analytic ranking covers a mixture of experts",
        )  # fmt: skip
    if not hf_dir:
        raise ConfigError(
            "--empirical", "measures an exported transformers model", "no --hf-dir given",
            "export the checkpoint (python -m ds_megatron.checkpoint export) and pass --hf-dir DIR",
        )  # fmt: skip
    if work.weight_dtype not in PROBE_DTYPES or work.kv_dtype != work.weight_dtype:
        raise ConfigError(
            "--weight-dtype",
            "the measuring run loads the model at one precision for weights and KV cache",
            f"weights {work.weight_dtype}, KV cache {work.kv_dtype}",
            f"pass --weight-dtype and --kv-dtype the same, one of {', '.join(PROBE_DTYPES)}",
        )
    if work.output_length < 2:
        raise ConfigError("--output-length", "TPOT needs a decode step", f"{work.output_length}", "pass at least 2")
    session.check_one_node(cl.num_gpus, cl.gpus_per_node)


def not_measured(result: InferenceResult, e: InferenceEvaluation) -> str | None:
    """Why the measuring run cannot run candidate ``e``, or None when it can."""
    if e.serving.pp > 1:
        return "pp > 1 (AutoTP has no pipeline)"
    why = family_of(result.model).no_autotp_inference
    if e.serving.tp > 1 and why:
        return f"tp > 1 ({why})"
    return None


def top_candidates(result: InferenceResult, top: int) -> list[InferenceEvaluation]:
    """The first ``top`` of the analytic ranking that the measuring run can run (``not_measured``), tp by tp."""
    picked = [e for e in result.evaluations if not_measured(result, e) is None][:top]
    order = {e.serving: i for i, e in enumerate(result.evaluations)}
    return sorted(picked, key=lambda e: (e.serving.tp, order[e.serving]))


def run_inference_empirical(
    result: InferenceResult,
    hf_dir: str,
    options: InferenceEmpiricalOptions,
    deadline: float,
    say: Callable[[str], None] = print,
) -> InferenceEmpiricalResult:
    """Measure the top candidates before ``deadline`` (a time.monotonic() value) in as few launches as
    ``launch_groups`` allows; recalibrate and rank again."""
    validate_options(result, options, hf_dir)
    start = time.monotonic()
    device = session.resolve_device(options.device, result.cluster.num_gpus)
    options = dataclasses.replace(
        options, device=device, work_dir=str(session.work_dir(options.work_dir, "-inference").resolve())
    )
    rank = {e.serving: i + 1 for i, e in enumerate(result.evaluations)}
    runs = [InferenceRun(i + 1, rank[e.serving], e) for i, e in enumerate(top_candidates(result, options.top))]
    emp = InferenceEmpiricalResult(options, max(0.0, deadline - start), runs)
    w = result.workload
    say(
        f"empirical: measuring {len(runs)} candidate(s) on {device.upper()} under deepspeed.init_inference (AutoTP), "
        f"prompt {w.prompt_length}, output {w.output_length}, {options.warmup} warm-up + {options.repeats} measured "
        f"request(s) each, {emp.budget_s / 60:.1f} min budget; runs in {options.work_dir}"
    )
    skipped = dict.fromkeys(why for e in result.evaluations if (why := not_measured(result, e)))
    if skipped:
        say(f"  not measured: {'; '.join(skipped)}")
    groups = launch_groups([r.evaluation.serving.tp for r in runs])
    budget = session.Budget(deadline)
    for pos, group in enumerate(groups):
        while pending := [r for r in runs if r.evaluation.serving.tp in group and r.status == session.NOT_RUN]:
            timeout, remaining = budget.next_timeout(len(groups) - pos)
            if timeout is None:
                say(f"  budget: {max(remaining, 0):.0f} s left is too little for another launch")
                break
            world = max(group)
            tps = " and ".join(str(t) for t in group)
            say(f"  tp {tps}: launching {len(pending)} candidate(s) on {world} process(es) (timeout {timeout:.0f} s)")
            launch = measure_launch(result, hf_dir, options, world, pending, len(emp.launches) + 1, timeout)
            emp.launches.append(launch)
            if launch.returncode is not None:
                budget.durations.append(launch.duration_s)
            for r in pending:
                if r.status != session.NOT_RUN:
                    say(f"      #{r.index} tp {r.evaluation.serving.tp}, batch {r.evaluation.serving.batch}: "
                        f"{_outcome_text(r)}")  # fmt: skip
            if all(r.status == session.NOT_RUN for r in pending) or launch.returncode is None:
                break  # nothing started (the launch itself failed) or the budget is spent: do not retry
    recalibrate(result, emp)
    emp.elapsed_s = budget.elapsed_s(options.max_minutes)
    return emp


def _outcome_text(r: InferenceRun) -> str:
    if r.measured is None:
        return f"{r.status}: {r.reason}"
    p, m = r.predicted, r.measured
    return f"TTFT {m.ttft * 1e3:.1f} ms (predicted {p.ttft * 1e3:.1f}), TPOT {m.tpot * 1e3:.2f} ms ({p.tpot * 1e3:.2f})"


def with_efficiency(cluster: Cluster, efficiency: float) -> Cluster:
    """``cluster`` with the compute efficiency ``efficiency`` and the bandwidth efficiency in the ratio of the two
    in ``cluster`` (the fitted defaults, or the flags'): the measuring runs fit one scale for both."""
    ratio = cluster.bandwidth_efficiency / cluster.efficiency
    return dataclasses.replace(cluster, efficiency=efficiency, bandwidth_efficiency=efficiency * ratio)


def _ceiling(cluster: Cluster) -> float:
    """The compute efficiency at which the larger of the two efficiencies is 1: the fit's bound."""
    return cluster.efficiency / max(cluster.efficiency, cluster.bandwidth_efficiency)


def inference_parts(result: InferenceResult, serving: Serving) -> dict[str, tuple[float, float, float]]:
    """TTFT's and TPOT's (C, N, B), predicted = C / scale + N x intra-node latency + B + overhead, where the
    efficiencies are ``scale`` times their largest values in the cluster's ratio (``with_efficiency``) and B holds
    the cluster's own overhead per forward (the engine preset's): both are linear in the three constants
    (inference_time), so three evaluations separate them.  The physical floors do not bind at a scale of at most 1."""
    top = _ceiling(result.cluster)
    base = dataclasses.replace(with_efficiency(result.cluster, top), intra_node_latency_s=0.0)
    t1 = inference_time(result.model, base, serving, result.workload)
    half = inference_time(result.model, with_efficiency(base, top / 2), serving, result.workload)
    unit = inference_time(result.model, dataclasses.replace(base, intra_node_latency_s=1.0), serving, result.workload)
    parts = {}
    for name in ("ttft", "tpot"):
        at1, at_half, at_unit = (getattr(t, f"{name}_s") for t in (t1, half, unit))
        c = at_half - at1
        parts[name] = (c, at_unit - at1, at1 - c)
    return parts


def fit_inference_model(result: InferenceResult, runs: list[InferenceRun], extra_terms=FIT_TERMS) -> Calibration:
    """Fit the efficiencies (one scale for both, in the cluster's ratio), and each of ``extra_terms`` (collective
    latency, a fixed per-forward overhead on top of the engine's) that clearly helps, to the measured TTFTs and TPOTs
    together (calibration.fit_parts: every figure's relative error counts the same).  The result's efficiency is
    the compute efficiency (``--efficiency``); ``with_efficiency`` gives the bandwidth efficiency beside it."""
    points = []
    for r in runs:
        parts = inference_parts(result, r.evaluation.serving)
        for name in ("ttft", "tpot"):
            measured = getattr(r.measured, name)
            if not measured > 0:
                raise ValueError(f"calibrate: measured {name.upper()} must be positive, got {measured}")
            points.append((*parts[name], result.cluster.intra_node_latency_s, measured))
    cal = fit_parts(points, extra_terms, unit="measured TTFTs and TPOTs")
    return dataclasses.replace(cal, efficiency=cal.efficiency * _ceiling(result.cluster))


def calibrated_cluster(cluster: Cluster, cal: Calibration) -> Cluster:
    """``cluster`` with the fitted constants: both efficiencies, the latency, the engine's overhead plus the fitted
    one."""
    fitted = cal.apply(with_efficiency(cluster, cal.efficiency))
    return dataclasses.replace(fitted, step_overhead_s=cluster.step_overhead_s + cal.step_overhead_s)


def recalibrate(result: InferenceResult, emp: InferenceEmpiricalResult) -> None:
    """Fit the model to the measured runs, search again with the fitted constants, build the final ranking."""
    ok = emp.ok
    emp.calibration, emp.calibration_note = session.fit_or_keep(ok, lambda: fit_inference_model(result, ok))
    cluster = calibrated_cluster(result.cluster, emp.calibration) if emp.calibration else result.cluster
    emp.recalibrated = search_inference(result.model, cluster, result.workload)
    again = {e.serving: e for e in emp.recalibrated.evaluations}
    for r in emp.runs:
        r.calibrated = figures_of(again[r.evaluation.serving]) if r.evaluation.serving in again else None
    for name in FIGURES:
        measured = [getattr(r.measured, name) for r in ok]
        before = session.spearman([getattr(r.predicted, name) for r in ok], measured)
        after = (
            session.spearman([getattr(r.calibrated, name) for r in ok], measured)
            if all(r.calibrated for r in ok)
            else None
        )
        emp.spearman[name] = (before, after)
    emp.final = final_ranking(emp.recalibrated, emp.runs)


def final_ranking(recalibrated: InferenceResult, runs: list[InferenceRun]) -> list[FinalEntry]:
    """Measured figures where a run measured them, the recalibrated prediction otherwise; failed runs left out;
    ordered as the analytic search orders (inference.rank_key), the limits judged on the figures shown."""
    measured = {r.evaluation.serving: r.measured for r in runs if r.measured is not None}
    failed = {r.evaluation.serving for r in runs if r.status not in ("ok", session.NOT_RUN)}
    key = lambda e: e.serving  # noqa: E731
    entries = [
        FinalEntry(*x)
        for x in session.measured_or_predicted(recalibrated.evaluations, key, measured, failed, figures_of)
    ]
    work = recalibrated.workload

    def key(f: FinalEntry) -> tuple:
        meets = meets_limits(work, f.figures.ttft, f.figures.tpot)
        return (*rank_key(meets, f.figures.tokens_per_s, f.figures.tpot, f.evaluation.serving.gpus_per_replica),
                f.source != "measured")  # fmt: skip

    return sorted(entries, key=key)
