"""How well the tuner's inference model predicts published serving measurements (ds_megatron.tune.inference.anchors):
the fit to all of them, each source predicted by a fit to the others (leave one source out), and the previous
model's errors on the same rows.  Analytic only, under two seconds.

    python benchmarks/inference_anchors.py [--markdown benchmarks/results/inference_anchors.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _results import write_markdown  # noqa: E402

from ds_megatron.tune.core.spec import DEFAULT_EFFICIENCY  # noqa: E402
from ds_megatron.tune.inference.anchors import ANCHORS, SOURCES, check_anchors  # noqa: E402
from ds_megatron.tune.inference.fit import POOLED, error_summary, fit_anchors, leave_one_source_out  # noqa: E402

COMMAND = "python benchmarks/inference_anchors.py --markdown benchmarks/results/inference_anchors.md"


def _figure(a, seconds: float) -> str:
    """A figure in the source's unit: ms, or output tokens/s."""
    if a.metric == "output_tokens_per_s":
        return f"{a.batch * a.output_length / seconds:,.0f} tok/s"
    return f"{seconds * 1e3:,.1f} ms"


def previous_ratio(a) -> float:
    """Measured over predicted by the model before the anchors: one factor (the training ceiling) for matmuls and
    reads, no overhead per forward, fp8 multiplied at the bf16 peak."""
    old = a.cluster(efficiency=DEFAULT_EFFICIENCY, bandwidth_efficiency=DEFAULT_EFFICIENCY, step_overhead_s=0.0)
    return a.ratio(dataclasses.replace(old, fp8_peak_tflops=None, int8_peak_tflops=None))


def body() -> str:
    check_anchors()
    fit, pooled, held = fit_anchors(), fit_anchors(pooled=True), leave_one_source_out()
    out = {id(h.anchor): h for h in held}
    lines = [
        f"{len(ANCHORS)} published measurements from {len(SOURCES)} sources (`ds_megatron/tune/inference/anchors.py`, "
        "each with its address and the mismatch it carries).  Ratios are measured / predicted (above 1: the model "
        "is optimistic).",
        "",
        "| # | source (engine) | row | measured | fit: predicted (ratio) | held out: predicted (ratio) | previous "
        "model ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, a in enumerate(ANCHORS, 1):
        p = a.predicted_s(a.cluster(**fit.constants(a.engine)))
        h = out[id(a)]
        mark = " *" if h.pooled else ""
        lines.append(
            f"| {i} | {a.source} ({a.engine}) | {a.label} | {_figure(a, a.measured_s)} | {_figure(a, p)} "
            f"({a.measured_s / p:.2f}) | {_figure(a, h.predicted_s)} ({h.ratio:.2f}){mark} | {previous_ratio(a):.2f} |"
        )
    over = ", ".join(f"{e} {s * 1e3:.2f} ms" for e, s in fit.overheads.items())
    med, worst = error_summary(held)
    prev = [previous_ratio(a) for a in ANCHORS]
    prev_err = [abs(r - 1) for r in prev]
    lines += [
        "",
        "\\* its engine has no other source: predicted with the pooled fit (one overhead for every engine).",
        "",
        f"**Fit to all {len(ANCHORS)} rows** (relative least squares, `inference_fit.fit_anchors`): matmuls at "
        f"{fit.efficiency:.4f} of the peak of their precision, reads at {fit.bandwidth_efficiency:.4f} of the HBM "
        f"bandwidth, per forward {over}; relative RMS error {fit.rms_error:.1%}.  One overhead for every engine "
        f"(the `deepspeed` preset): {pooled.overheads[POOLED] * 1e3:.2f} ms (efficiencies {pooled.efficiency:.3f} "
        f"and {pooled.bandwidth_efficiency:.3f}, RMS {pooled.rms_error:.1%}).",
        "",
        f"**Leave one source out** (each source's rows predicted by the fit to the other sources): median "
        f"|measured / predicted - 1| {med:.1%}, worst {worst:.1%} (acceptance: 10% and 30%); first-token latency "
        f"{error_summary(held, 'ttft')[0]:.1%} / {error_summary(held, 'ttft')[1]:.1%}, decode figures (TPOT, batch "
        f"times, throughputs) {error_summary(held, 'tpot')[0]:.1%} / {error_summary(held, 'tpot')[1]:.1%} (median / "
        "worst).",
        "",
        f"**The previous model** (one factor {DEFAULT_EFFICIENCY} for matmuls and reads, no overhead, fp8 at the "
        f"bf16 peak) on the same rows: median ratio {statistics.median(prev):.2f}, median |ratio - 1| "
        f"{statistics.median(prev_err):.1%}, worst {max(prev_err):.1%} (ratio {min(prev):.2f} to {max(prev):.2f}).",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", help="write the result here")
    args = parser.parse_args()
    text = body()
    print(text)
    if args.markdown:
        write_markdown(args.markdown, "Inference model against published measurements", COMMAND, text)


if __name__ == "__main__":
    main()
