"""The empirical mode's console section: each run against its predictions, the calibration, the rank correlation and
the final ranking (measured where measured)."""

from __future__ import annotations

from ds_megatron.tune.empirical import PEAK_MEM_NOTE, EmpiricalResult, FinalEntry
from ds_megatron.tune.report import efficiency_text, layout_cells, seconds_text, settings_text, table, widened

LAYOUT_COLUMNS = (("tp", 3), ("pp", 3), ("dp", 3), ("sp", 3), ("b", 3), ("m", 4), ("attn", 5), ("recompute", 17))
RESULT_COLUMNS = (("predicted s", 11), ("calibrated s", 12), ("measured s", 10), ("error", 7), ("peak mem", 9))
EMPIRICAL_COLUMNS = (("#", 2), ("rank", 4), *LAYOUT_COLUMNS, ("status", 13), *RESULT_COLUMNS)
FINAL_COLUMNS = (("rank", 4), *LAYOUT_COLUMNS, ("step s", 8), ("tokens/s", 10), ("source", 9))


def calibration_text(cal, overhead: str) -> tuple[str, str, str]:
    """What a calibration fitted, the tuner flags that rank with it, and its error, as the training and the inference
    reports print them; ``overhead`` is the fitted fixed overhead in the report's own unit."""
    parts = [f"efficiency {efficiency_text(cal.efficiency)}"]
    flags = [f"--efficiency {cal.efficiency:.4g}"]
    if cal.intra_node_latency_s is not None:
        parts.append(f"collective latency {cal.intra_node_latency_s * 1e6:,.0f} us")
        flags.append(f"--intra-node-latency-us {cal.intra_node_latency_s * 1e6:.4g}")
    if cal.step_overhead_s:
        parts.append(f"fixed overhead {overhead}")
        flags.append(f"--step-overhead-s {cal.step_overhead_s:.4g}")
    error = f"relative RMS error {cal.rms_error:.1%}"
    if len(cal.terms) > 1:
        error += f" ({cal.rms_error_efficiency_only:.1%} with the efficiency alone)"
    return ", ".join(parts), " ".join(flags), error


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
    not_run = [str(r.index) for r in emp.runs if r.outcome is None]
    if not_run:
        lines.append(f"  not run (the {o.max_minutes:g} min budget would be exceeded): #{', #'.join(not_run)}")
    lines.append(
        "  predicted: analytic model; calibrated: refitted model; measured: median step of the run; error: calibrated"
        " vs measured"
    )
    lines.append(f"  {PEAK_MEM_NOTE[o.device]}")
    cal = emp.calibration
    if cal is None:
        lines.append(f"calibration: {emp.calibration_note}")
    else:
        parts, flags, error = calibration_text(cal, f"{seconds_text(cal.step_overhead_s)} s per step")
        lines.append(f"calibration from {cal.num_measurements} run(s): {parts}; {error}")
        lines.append(f"  {cal.note}; rank with these numbers: {flags}")
    n = len(emp.measured)
    if emp.spearman_before is None:
        lines.append(f"rank correlation (Spearman): n/a ({n} measured candidate(s); needs 2 with different times)")
    else:
        after = f"{emp.spearman_after:+.2f}" if emp.spearman_after is not None else "n/a"
        lines.append(
            f"rank correlation (Spearman) with the measured step times over {n} candidates: analytic "
            f"{emp.spearman_before:+.2f}, calibrated {after}"
        )
    if not emp.final:
        lines.append("final ranking: nothing left (every measured candidate failed and nothing else fits)")
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
    w = emp.final[0]
    lines.append(f"final winner ({w.source}): {_describe_final(w, global_batch_size, seq_length)}")
    if w.source == "predicted":
        best = next((f for f in emp.final if f.source == "measured"), None)
        lines.append("  not measured: the recalibrated model predicts it beats every measured candidate")
        if best is not None:
            lines.append(f"  best measured: {_describe_final(best, global_batch_size, seq_length)}")
    return "\n".join(lines)


def _describe_final(f: FinalEntry, global_batch_size: int, seq_length: int) -> str:
    tokens = global_batch_size * seq_length / f.step_s
    return f"{settings_text(f.evaluation.candidate)}: {seconds_text(f.step_s)} s/step, {tokens:,.0f} tokens/s"
