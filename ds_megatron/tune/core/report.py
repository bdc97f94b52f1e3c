"""The empirical report's scaffolding both halves print around their own tables: the calibration, the rank
correlation, the runs not run, the final winner and the best measured candidate."""

from __future__ import annotations

from collections.abc import Callable

NOTHING_LEFT = "final ranking: nothing left (every measured candidate failed and nothing else fits)"


def efficiency_text(x: float) -> str:
    return f"{x:.2f}" if x >= 0.01 else f"{x:.3g}"


def text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Right-aligned columns, each as wide as its widest cell."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]


def not_run_lines(indices: list[int], max_minutes: float) -> list[str]:
    if not indices:
        return []
    return [f"  not run (the {max_minutes:g} min budget would be exceeded): #{', #'.join(map(str, indices))}"]


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


def calibration_lines(
    cal, note: str, source: str, overhead: Callable[[float], str], shown=None, more: tuple[str, str] = ("", "")
) -> list[str]:
    """The calibration's two lines, or why there is none (``note``).  ``source``: what it was fitted to, ``{n}``
    standing for its number of points; ``overhead``: a fixed overhead in seconds in the report's own unit; ``shown``:
    the calibration whose constants are printed (default ``cal``); ``more``: text after the fitted parts and flags."""
    if cal is None:
        return [f"calibration: {note}"]
    shown = shown or cal
    parts, flags, error = calibration_text(shown, overhead(shown.step_overhead_s))
    return [
        f"calibration from {source.format(n=cal.num_measurements)}: {parts}{more[0]}; {error}",
        f"  {cal.note}; rank with these numbers: {flags}{more[1]}",
    ]


def correlation_line(count: int, pairs: list[tuple[str, float | None, float | None]], figures: str, alike: str) -> str:
    """Spearman's rank correlations of the analytic and the calibrated predictions with the ``count`` measured
    candidates' ``figures``, one (label, analytic, calibrated) pair a figure; n/a where none could be computed (every
    measured figure ``alike``)."""
    shown = [
        f"{label}analytic {before:+.2f}, calibrated " + (f"{after:+.2f}" if after is not None else "n/a")
        for label, before, after in pairs
        if before is not None
    ]
    if not shown:
        return f"rank correlation (Spearman): n/a ({count} measured candidate(s); needs 2 with different {alike})"
    return f"rank correlation (Spearman) with the measured {figures} over {count} candidates: {'; '.join(shown)}"


def winner_lines(final: list, describe: Callable) -> list[str]:
    """The final winner (the first of ``final``) and where its figures come from; when it was only predicted, the
    best measured one."""
    winner = final[0]
    lines = [f"final winner ({winner.source}): {describe(winner)}"]
    if winner.source == "predicted":
        best = next((f for f in final if f.source == "measured"), None)
        lines.append("  not measured: the recalibrated model predicts it beats every measured candidate")
        if best is not None:
            lines.append(f"  best measured: {describe(best)}")
    return lines
