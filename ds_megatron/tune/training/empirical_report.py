"""The empirical mode's console section: each run against its predictions, the calibration, the rank correlation and
the final ranking (measured where measured)."""

from __future__ import annotations

from ds_megatron.tune.core import report as core_report
from ds_megatron.tune.training.empirical import PEAK_MEM_NOTE, EmpiricalResult, FinalEntry
from ds_megatron.tune.training.report import layout_cells, seconds_text, settings_text, table, widened

LAYOUT_COLUMNS = (("tp", 3), ("pp", 3), ("dp", 3), ("sp", 3), ("b", 3), ("m", 4), ("attn", 5), ("recompute", 17))
RESULT_COLUMNS = (("predicted s", 11), ("calibrated s", 12), ("measured s", 10), ("error", 7), ("peak mem", 9))
EMPIRICAL_COLUMNS = (("#", 2), ("rank", 4), *LAYOUT_COLUMNS, ("status", 13), *RESULT_COLUMNS)
FINAL_COLUMNS = (("rank", 4), *LAYOUT_COLUMNS, ("step s", 8), ("tokens/s", 10), ("source", 9))


def format_empirical(emp: EmpiricalResult, global_batch_size: int, seq_length: int, top: int = 10) -> str:
    """The empirical section: each run against its predictions, the calibration, the correlation, the final ranking."""
    o = emp.options
    kind = "CPU process(es), gloo, fp32" if o.device == "cpu" else "GPU(s), bf16, ZeRO-1"
    lines = [
        "",
        f"empirical: {len(emp.runs)} candidate(s) on {emp.processes} {kind}; {o.warmup} warm-up + {o.steps} measured "
        f"steps each; {emp.elapsed_s / 60:.1f} of {o.max_minutes:g} min used",
    ]
    rows, reasons = [], []
    for r in emp.runs:
        m, cal = r.measured_s, r.calibrated_s
        error = f"{(cal - m) / m:+.0%}" if m is not None and cal is not None else "-"
        peak = r.outcome.peak_mem_gb if r.outcome else None
        cells = [str(r.index), str(r.rank), *layout_cells(r.evaluation.candidate), r.status]
        cells += [seconds_text(r.predicted_s), seconds_text(cal) if cal is not None else "-"]
        cells += [seconds_text(m) if m is not None else "-", error, f"{peak:.2f} GB" if peak is not None else "-"]
        rows.append(cells)
        if r.outcome is not None and r.outcome.reason:
            reasons.append(f"  #{r.index} {r.status}: {r.outcome.reason}")
    lines += table(rows, widened(EMPIRICAL_COLUMNS, [r.evaluation for r in emp.runs])) + reasons
    lines += core_report.not_run_lines(emp.not_run, o.max_minutes)
    lines.append(
        "  predicted: analytic model; calibrated: refitted model; measured: median step of the run; error: calibrated"
        " vs measured"
    )
    lines.append(f"  {PEAK_MEM_NOTE[o.device]}")
    per_step = lambda s: f"{seconds_text(s)} s per step"  # noqa: E731
    lines += core_report.calibration_lines(emp.calibration, emp.calibration_note, "{n} run(s)", per_step)
    pairs = [("", emp.spearman_before, emp.spearman_after)]
    lines.append(core_report.correlation_line(len(emp.measured), pairs, "step times", "times"))
    if not emp.final:
        lines.append(core_report.NOTHING_LEFT)
        return "\n".join(lines)
    lines.append(
        "final ranking (measured step time where measured, else the calibrated prediction; failed runs left out):"
    )
    rows = [
        [str(i + 1), *layout_cells(f.evaluation.candidate), seconds_text(f.step_s)]
        + [f"{global_batch_size * seq_length / f.step_s:,.0f}", f.source]
        for i, f in enumerate(emp.final[:top])
    ]
    lines += table(rows, widened(FINAL_COLUMNS, [f.evaluation for f in emp.final[:top]]))
    lines += core_report.winner_lines(emp.final, lambda f: _describe_final(f, global_batch_size, seq_length))
    return "\n".join(lines)


def _describe_final(f: FinalEntry, global_batch_size: int, seq_length: int) -> str:
    tokens = global_batch_size * seq_length / f.step_s
    return f"{settings_text(f.evaluation.candidate)}: {seconds_text(f.step_s)} s/step, {tokens:,.0f} tokens/s"
