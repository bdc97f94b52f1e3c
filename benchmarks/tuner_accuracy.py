"""How well the tuner's time model predicts real runs: published GPU step times, and ranking on 4 CPU processes.

    python benchmarks/tuner_accuracy.py [--steps 20 --warmup 5] [--markdown benchmarks/results/tuner_accuracy.md]
    python benchmarks/tuner_accuracy.py --paper-only [--markdown benchmarks/results/tuner_paper_accuracy.md]
        # the first table alone, in well under a second

First, the analytic model against the iteration times and MFU Korthikanti et al. 2022 measured on A100s (Table 5:
ds_megatron.tune.training.paper_runs), at the default matmul ceiling, which was fitted on two of those eight rows.

Then the tiny GPT (L 4, h 128, a 4, V 1024, s 128, global batch 16) on 4 gloo CPU processes.  Eight candidates chosen to
span the search space (dp only, TP, PP, TP x PP, SP, selective and full recompute, few and many micro-batches) go
through the tuner's empirical mode (ds_megatron.tune.training.empirical: the same probes, launches and calibration as
``python -m ds_megatron.tune --empirical``).  Reported per candidate: the analytic prediction, the recalibrated one,
a leave-one-out prediction (calibrated on the other seven, so not fitted to the run it predicts) and the median
measured step; then the Spearman rank correlations.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _results import write_markdown  # noqa: E402

from ds_megatron.tune import Cluster, Measurement, build_model_shape, fit_time_model, search, step_time  # noqa: E402
from ds_megatron.tune.core.calibration import FIT_TERMS  # noqa: E402
from ds_megatron.tune.core.session import spearman  # noqa: E402
from ds_megatron.tune.core.spec import DEFAULT_EFFICIENCY  # noqa: E402
from ds_megatron.tune.training.empirical import EmpiricalResult, run_empirical  # noqa: E402
from ds_megatron.tune.training.paper_runs import FIT_ROWS, MODES, TABLE5  # noqa: E402
from ds_megatron.tune.training.probe import EmpiricalOptions  # noqa: E402
from ds_megatron.tune.training.search import Evaluation, SearchResult  # noqa: E402

GPUS = 4
GLOBAL_BATCH = 16
PEAK_TFLOPS = 0.05  # a nominal per-process peak: calibration fits the efficiency against it
NOMINAL_EFFICIENCY = 0.5  # the same for the efficiency (the GPU default was fitted on A100s and means nothing here)
MODE_TEXT = {"full": "full recompute", "selective": "SP + selective"}
# (tp, pp, sequence_parallel, micro_batch_size, recompute label)
CANDIDATES = [
    (1, 1, False, 4, "none"),
    (1, 1, False, 1, "full/uniform/1"),
    (4, 1, False, 16, "none"),
    (4, 1, True, 4, "selective"),
    (2, 2, True, 4, "selective"),
    (2, 1, False, 2, "full/uniform/1"),
    (1, 2, False, 1, "none"),
    (1, 4, False, 1, "none"),
]


def paper_table() -> list[str]:
    """Predicted vs published iteration time and MFU of the eight Table 5 runs, at the default ceiling."""
    rows = [
        "| model | GPUs (tp x pp) | batch (micro) | recompute | published s | predicted s | error | published MFU | "
        "predicted MFU | matmuls at |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in TABLE5:
        for mode in MODES:
            m = run.measurement(mode)
            t = step_time(m.model, m.cluster, m.candidate, m.global_batch_size)
            fitted = " (fitted)" if (run.name, mode) in FIT_ROWS else ""
            published_mfu = f"{run.measured_mfu(mode):.1%}" + (" (from the time)" if mode == "full" else "")
            rows.append(
                f"| {run.name} | {run.num_gpus} ({run.tp} x {run.pp}) | {run.global_batch_size} "
                f"({run.micro_batch_size}) | {MODE_TEXT[mode]}{fitted} | {m.step_time_s:.2f} | {t.step_s:.2f} | "
                f"{t.step_s / m.step_time_s - 1:+.1%} | {published_mfu} | {t.mfu:.1%} | {t.matmul_efficiency:.0%} |"
            )
    return rows


def paper_text() -> str:
    return (
        f"Against published GPU step times (Korthikanti et al. 2022, Table 5, A100 80GB, s 2048, V 51,200, dp 1): "
        f"the analytic model at its default matmul ceiling {DEFAULT_EFFICIENCY}, fitted on the two rows marked; "
        "the other six are predictions.  The paper prints the MFU of its SP + selective runs; a full-recompute "
        "run's MFU follows from its time (same FLOPs, same GPUs).  \"matmuls at\": the fraction of the A100's peak "
        "the slowest stage's matmuls run at (ds_megatron.tune.core.matmuls).\n\n" + "\n".join(paper_table())
    )


def pick(result: SearchResult) -> list[Evaluation]:
    chosen = []
    for tp, pp, sp, b, label in CANDIDATES:
        found = [
            e
            for e in result.ranked
            if (e.candidate.tp, e.candidate.pp, e.candidate.sequence_parallel, e.candidate.micro_batch_size)
            == (tp, pp, sp, b)
            and e.candidate.recompute_label() == label
        ]
        if not found:
            raise SystemExit(f"candidate tp {tp} pp {pp} sp {sp} b {b} {label} is not in the search space")
        chosen.append(found[0])
    return chosen


def leave_one_out(result: SearchResult, emp: EmpiricalResult) -> dict:
    """Prediction of each measured run by a model calibrated on the other runs only."""
    measured = emp.measured
    out = {}
    for r in measured:
        others = [
            Measurement(result.model, result.cluster, o.evaluation.candidate, GLOBAL_BATCH, o.measured_s)
            for o in measured
            if o is not r
        ]
        cal = fit_time_model(others, extra_terms=FIT_TERMS)
        out[r.index] = step_time(result.model, cal.apply(result.cluster), r.evaluation.candidate, GLOBAL_BATCH).step_s
    return out


def calibration_text(cal) -> str:
    parts = [f"efficiency {cal.efficiency:.3g} of the nominal {PEAK_TFLOPS} TFLOP/s per process"]
    if cal.intra_node_latency_s is not None:
        parts.append(f"collective latency {cal.intra_node_latency_s * 1e3:.2f} ms")
    if cal.step_overhead_s:
        parts.append(f"fixed overhead {cal.step_overhead_s:.3f} s per step")
    return (
        f"{', '.join(parts)}; relative RMS error {cal.rms_error:.1%} ({cal.rms_error_efficiency_only:.1%} with the "
        f"efficiency alone); {cal.note}"
    )


def reading(cal) -> str:
    """How to read the table (the mechanisms do not depend on the run; the fitted latency does)."""
    latency = (
        f"the fitted {cal.intra_node_latency_s * 1e3:.1f} ms"
        if cal is not None and cal.intra_node_latency_s is not None
        else "milliseconds"
    )
    return (
        "Reading it: the analytic model assumes each process has a GPU's compute to itself and NVLink-class "
        "collectives (20 us each).  Here 4 processes share 2 cores and a gloo collective between them costs "
        f"{latency}, so layouts that run many TP collectives per step (tp 4 with SP: about 150 per step at 4 "
        "micro-batches) are several times slower than predicted and the uncalibrated ranking is weak.  Fitting the "
        "collective latency next to the efficiency recovers most of the ranking, also for runs left out of the fit.  "
        "What remains is what the model does not describe: an idle pipeline stage gives its core to the busy ones "
        "(the 1F1B bubble costs less than predicted on shared cores), SP's LayerNorm-gradient all-reduces and the "
        "backward all-gather of sec. 4.2.2 are not counted, and other jobs on the 2 cores add noise."
    )


def label(e: Evaluation) -> str:
    c = e.candidate
    return (
        f"tp {c.tp} pp {c.pp} dp {c.dp} SP {'on' if c.sequence_parallel else 'off'} "
        f"b {c.micro_batch_size}x{c.num_micro_batches} {c.recompute_label()}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="measured steps per candidate")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps dropped per candidate")
    p.add_argument("--max-minutes", type=float, default=20.0)
    p.add_argument("--work-dir", default="runs/tuner_accuracy")
    p.add_argument("--markdown", help="write the results as markdown to this file")
    p.add_argument("--paper-only", action="store_true", help="print the published-step-time table and stop")
    args = p.parse_args()
    print(paper_text() + "\n")
    if args.paper_only:
        if args.markdown:
            command = "python benchmarks/tuner_accuracy.py --paper-only"
            write_markdown(args.markdown, "Tuner accuracy against published GPU step times", command, paper_text())
            print(f"wrote {args.markdown}")
        return

    start = time.monotonic()
    load_before = os.getloadavg()[0]
    model = build_model_shape("gpt-tiny", None, None, None, 1024, 128)
    cluster = Cluster(
        num_gpus=GPUS, gpus_per_node=GPUS, gpu_memory_gb=3, peak_tflops=PEAK_TFLOPS, efficiency=NOMINAL_EFFICIENCY
    )
    result = search(model, cluster, GLOBAL_BATCH)
    options = EmpiricalOptions(
        args.max_minutes, steps=args.steps, warmup=args.warmup, device="cpu", work_dir=args.work_dir
    )
    emp = run_empirical(result, options, start + 60 * args.max_minutes, chosen=pick(result))
    loo = leave_one_out(result, emp) if len(emp.measured) >= 3 else {}

    cal = emp.calibration
    rows = [
        "| candidate | analytic rank | predicted s (analytic) | calibrated s | leave-one-out s | measured s | "
        "calibrated error | peak RSS GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in emp.runs:
        m = r.measured_s
        if m is None:
            rows.append(f"| {label(r.evaluation)} | {r.rank} | {r.predicted_s:.3f} | - | - | {r.status} | - | - |")
            continue
        rows.append(
            f"| {label(r.evaluation)} | {r.rank} | {r.predicted_s:.3f} | {r.calibrated_s:.3f} | "
            f"{loo.get(r.index, float('nan')):.3f} | {m:.3f} | {(r.calibrated_s - m) / m:+.1%} | "
            f"{r.outcome.peak_mem_gb:.2f} |"
        )
    measured = emp.measured
    loo_rho = spearman([loo[r.index] for r in measured], [r.measured_s for r in measured]) if loo else None

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:+.2f}"

    summary = [
        f"Spearman rank correlation with the measured step times ({len(measured)} candidates): analytic "
        f"{fmt(emp.spearman_before)}, calibrated {fmt(emp.spearman_after)}, leave-one-out {fmt(loo_rho)}.",
        "",
        f"Calibration: {calibration_text(cal)}." if cal else f"Calibration: {emp.calibration_note}.",
    ]
    summary += ["", reading(cal)]
    print("\n".join(rows + [""] + summary))
    if args.markdown:
        cores = os.cpu_count()
        import torch

        header = (
            f"# Tuner accuracy benchmark\n\n{datetime.date.today().isoformat()}, {platform.machine()} ({cores} cores), "
            f"torch {torch.__version__}, `python benchmarks/tuner_accuracy.py --steps {args.steps} --warmup "
            f"{args.warmup}`, {emp.elapsed_s / 60:.1f} min, 1-minute load average {load_before:.1f} before and "
            f"{os.getloadavg()[0]:.1f} after (other jobs on the cores slow the runs unevenly)\n\n"
            f"The tiny GPT (L 4, h 128, a 4, V 1024, s 128), global batch {GLOBAL_BATCH}, on {GPUS} gloo CPU processes "
            f"(fp32), each candidate launched by the tuner's empirical mode: {args.warmup} warm-up steps dropped, "
            f"median of {args.steps} measured steps.  Predicted: the analytic time model at a nominal efficiency "
            f"{NOMINAL_EFFICIENCY} of a nominal {PEAK_TFLOPS} TFLOP/s per process.  Calibrated: refitted to all "
            "measured runs (in-sample).  Leave-one-out: refitted to the other runs only.  Peak RSS: the logging "
            "process's max RSS (not a stage's device memory).\n\n"
        )
        with open(args.markdown, "w") as f:
            f.write(header + "\n".join(rows + [""] + summary) + "\n\n" + paper_text() + "\n")
        print(f"wrote {args.markdown}")


if __name__ == "__main__":
    main()
