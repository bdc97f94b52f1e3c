"""The inference empirical mode's console section: each candidate's TTFT, TPOT and tokens/s predicted, recalibrated
and measured, the calibration, the rank correlations and the final ranking (measured where measured)."""

from __future__ import annotations

import dataclasses

from ds_megatron.tune.core import report as core_report
from ds_megatron.tune.core.session import NOT_RUN
from ds_megatron.tune.inference.empirical import REPLICAS_NOTE, FinalEntry, InferenceEmpiricalResult
from ds_megatron.tune.inference.probe import Figures

PEAK_NOTE = {
    "cpu": "peak mem: max RSS of rank 0 so far in its launch (the model, torch and every earlier batch included)",
    "gpu": "peak mem: torch.cuda.max_memory_allocated of rank 0 for the candidate",
}
FIGURE_NAMES = {"tpot": "TPOT", "ttft": "TTFT", "tokens_per_s": "tokens/s"}


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}" if seconds >= 0.01 else f"{seconds * 1e3:.3f}"


def rate(tokens_per_s: float | None) -> str:
    return "-" if tokens_per_s is None else f"{tokens_per_s:,.0f}"


def _three(fig: str, p: Figures | None, c: Figures | None, m: Figures | None) -> list[str]:
    text = rate if fig == "tokens_per_s" else ms
    return [text(getattr(f, fig)) if f else "-" for f in (p, c, m)]


def format_inference_empirical(emp: InferenceEmpiricalResult, top: int = 10) -> str:
    o = emp.options
    lines = [
        "",
        f"empirical: {len(emp.runs)} candidate(s) on {o.device.upper()} in {len(emp.launches)} launch(es) "
        f"(tp 1 and the widest tp share one, every other tp has its own); {o.warmup} warm-up + {o.repeats} "
        f"measured request(s) each; {emp.elapsed_s / 60:.1f} of {o.max_minutes:g} min used",
    ]
    header = ["#", "rank", "tp", "batch", "replicas", "status"]
    for fig, unit in (("ttft", "ms"), ("tpot", "ms"), ("tokens_per_s", "")):
        name = FIGURE_NAMES[fig] + (f" {unit}" if unit else "")
        header += [f"{name} pred", "calib", "measured"]
    header.append("peak mem")
    rows, reasons = [], []
    for r in emp.runs:
        s = r.evaluation.serving
        row = [str(r.index), str(r.rank), str(s.tp), str(s.batch), str(s.replicas), r.status]
        for fig in ("ttft", "tpot", "tokens_per_s"):
            row += _three(fig, r.predicted, r.calibrated, r.measured)
        row.append(f"{r.peak_mem_gb:.2f} GB" if r.peak_mem_gb is not None else "-")
        rows.append(row)
        if r.status not in ("ok", NOT_RUN):
            reasons.append(f"  #{r.index} {r.status}: {r.reason}")
    lines += core_report.text_table(header, rows) + reasons
    lines += core_report.not_run_lines(emp.not_run, o.max_minutes)
    lines.append("  pred: analytic model; calib: refitted model; measured: TTFT the median prefill, TPOT the mean step")
    lines.append(f"  {REPLICAS_NOTE}; {PEAK_NOTE[o.device]}")
    lines += _calibration_lines(emp)
    lines += _ranking_lines(emp, top)
    return "\n".join(lines)


def _calibration_lines(emp: InferenceEmpiricalResult) -> list[str]:
    cal, shown, more = emp.calibration, None, ("", "")
    if cal is not None:
        # The flags rank with the recalibrated cluster: its bandwidth efficiency (the compute one's ratio kept) and
        # its whole overhead per forward (the engine's plus the fitted one).
        fitted = emp.recalibrated.cluster
        shown = dataclasses.replace(cal, step_overhead_s=fitted.step_overhead_s if cal.step_overhead_s else 0.0)
        bandwidth = fitted.bandwidth_efficiency
        more = (
            f", bandwidth efficiency {bandwidth:.3g} (in the defaults' ratio)",
            f" --bandwidth-efficiency {bandwidth:.4g}",
        )
    source = f"{{n}} figures (TTFT and TPOT of {len(emp.ok)} run(s))"
    per_forward = lambda s: f"{ms(s)} ms per forward"  # noqa: E731
    lines = core_report.calibration_lines(cal, emp.calibration_note, source, per_forward, shown, more)
    pairs = [(f"{FIGURE_NAMES[fig]} ", before, after) for fig, (before, after) in emp.spearman.items()]
    lines.append(core_report.correlation_line(len(emp.ok), pairs, "figures", "figures"))
    return lines


def _ranking_lines(emp: InferenceEmpiricalResult, top: int) -> list[str]:
    if not emp.final:
        return [core_report.NOTHING_LEFT]
    lines = ["final ranking (measured where measured, else the calibrated prediction; failed runs left out):"]
    header = ["rank", "tp", "pp", "batch", "replicas", "tok/s all", "TTFT ms", "TPOT ms", "source"]
    rows = [
        [str(i + 1), *(str(x) for x in (f.evaluation.serving.tp, f.evaluation.serving.pp, f.evaluation.serving.batch)),
         str(f.evaluation.serving.replicas), rate(f.figures.tokens_per_s), ms(f.figures.ttft), ms(f.figures.tpot),
         f.source]
        for i, f in enumerate(emp.final[:top])
    ]  # fmt: skip
    lines += core_report.text_table(header, rows)
    if emp.winner is None:
        lines.append("no configuration meets the limits (measured where measured): the closest are ranked first")
        return lines
    return lines + core_report.winner_lines(emp.final, _describe)


def _describe(f: FinalEntry) -> str:
    s, x = f.evaluation.serving, f.figures
    return (
        f"tp {s.tp} x pp {s.pp}, batch {s.batch}, {s.replicas} replica{'s' if s.replicas > 1 else ''}: "
        f"{x.tokens_per_s:,.0f} output tokens/s, TTFT {ms(x.ttft)} ms, TPOT {ms(x.tpot)} ms"
    )
