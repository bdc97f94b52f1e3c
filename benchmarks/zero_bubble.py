"""Pipeline idle time of one training step, DeepSpeed's 1F1B against ZB-H1 and ZB-H2, measured per rank, next to
the tuner's predicted bubble.

    python benchmarks/zero_bubble.py [--pp 2] [--micro-batches 4 8 16] [--repeats 7] [--shapes 512x64 256x128]
        [--blocking] [--markdown OUT]

pp processes under the deepspeed launcher (CPU, gloo, one thread each; pp 4 on a 2-core machine oversubscribes it),
a GPT-2 of 2 pp layers (2 per stage), 8 heads, micro-batch 2, fp32.  Every instruction of a step is timed on every
rank (the worker is tests/workers/zero_bubble.py), at each hidden x sequence shape: compute (forward, B, W, loading
a micro-batch), idle (the pipeline's receives, which block until the other stage has sent; its sends, async
(``parallel.p2p``), which return at once; the wait for those sends to complete and the tied-embedding all-reduce,
both at the step's first reduction, where the stage done first waits: the bubble), and the gradient reduction and
optimizer.  Idle is also shown split: the wait for the async sends, and the all-reduce with the wait in it for
the other stage (stage imbalance: no schedule removes it).
The schedules and every micro-batch count are interleaved within each repeat, so machine noise hits them alike; the
median over the repeats is reported with its range.

Prediction: the tuner's bubble (``tune.training.schedules.bubble_s``, owner of the formulas and of ZB-H2's simulated
order) from this run's own per-pass costs, T_F, T_B and T_W (1F1B: its fused backward as T_B), each the median over
the repeats of the slowest rank's mean seconds per pass; it is compared with the measured bubble, the idle time of
the rank that computes most (the critical path's wait: the others idle as long plus their lighter share), as a
fraction of the step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import OtherWork, write_markdown  # noqa: E402
from launch import WORKERS, deepspeed_launch  # noqa: E402

from ds_megatron.tune.training.schedules import bubble_s  # noqa: E402

BLOCKING = "+blocking"  # the worker's name for a schedule run with DeepSpeed's blocking sends
PASSES = ("ForwardPass", "BackwardPass", "WeightGradPass")  # T_F, T_B, T_W


def run(micro_batches: list[int], repeats: int, hidden: int, seq: int, pp: int, blocking: bool) -> list[dict]:
    """Every rank's rows: one per (repeat, m, schedule) with seconds of compute, wait, step work and the step."""
    with tempfile.TemporaryDirectory() as out:
        args = ["--out", out, "--measure", "--repeats", str(repeats), "--micro-batches", *map(str, micro_batches)]
        args += ["--hidden", str(hidden), "--seq", str(seq), "--pp", str(pp)] + ["--blocking"] * blocking
        deepspeed_launch(WORKERS / "zero_bubble.py", pp, args, timeout=3000)
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("measure.rank*.json"))]


def spread(values: list[float]) -> str:
    """Median (min-max) in ms."""
    ms = [v * 1e3 for v in values]
    return f"{statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f})"


def per_pass(rows: list[dict]) -> tuple[float, float, float]:
    """(T_F, T_B, T_W): median over the repeats of one rank's mean seconds per pass (0 where it ran none)."""
    return tuple(
        statistics.median(row.get(kind, 0.0) / max(row.get(f"n_{kind}", 0), 1) for row in rows) for kind in PASSES
    )  # type: ignore[return-value]


def baseline(name: str) -> str:
    """The 1F1B run that schedule ``name`` is compared with: the one with the same sends."""
    return "1f1b" + (BLOCKING if name.endswith(BLOCKING) else "")


def table(ranks: list[dict], micro_batches: list[int], names: tuple[str, ...]) -> tuple[str, list[str]]:
    """Per (m, schedule, rank): compute, idle, the optimizer's own work and the step; per (m, schedule) the
    predicted against the measured bubble; and one verdict per m.

    Idle is the time blocked in the pipeline's sends and receives plus the step's first reduction
    (``ReduceTiedGrads``): the wait for the step's async sends, then the tied-embedding all-reduce (the stage that
    finishes first waits there for the other: the cooldown bubble and any stage imbalance land in it); the
    all-reduce's own transfer is a few milliseconds of that."""
    pp = len(ranks)
    lines = [
        "| m | schedule | rank | compute (ms) | idle (ms) | of which send wait (ms) | of which tied all-reduce (ms) "
        "| grad reduction + optimizer (ms) | step (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    predicted = [
        "| m | schedule | T_F, T_B, T_W (ms) | predicted bubble (ms) | measured bubble (ms) | difference / step |",
        "|---|---|---|---|---|---|",
    ]
    verdicts = []
    for m in micro_batches:
        med, costs = {}, {}
        for name in names:
            for r in ranks:
                rows = [row for row in r["rows"] if row["m"] == m and row["schedule"] == name]
                cols = {
                    "compute": [row["compute"] for row in rows],
                    "idle": [row["wait"] + row.get("ReduceTiedGrads", 0.0) for row in rows],
                    "send_wait": [row.get("SendWait", 0.0) for row in rows],
                    "tied": [row.get("ReduceTiedGrads", 0.0) - row.get("SendWait", 0.0) for row in rows],
                    "optimizer": [row.get("ReduceGrads", 0.0) + row.get("OptimizerStep", 0.0) for row in rows],
                    "step": [row["step_total"] for row in rows],
                }
                med[(name, r["pp_rank"])] = {k: statistics.median(v) for k, v in cols.items()}
                costs[(name, r["pp_rank"])] = per_pass(rows)
                lines.append(
                    f"| {m} | {name} | {r['pp_rank']} | {spread(cols['compute'])} | {spread(cols['idle'])} "
                    f"| {spread(cols['send_wait'])} | {spread(cols['tied'])} "
                    f"| {spread(cols['optimizer'])} | {spread(cols['step'])} |"
                )
        for name in names:
            t_f, t_b, t_w = (max(costs[(name, rk)][i] for rk in range(pp)) for i in range(3))
            guess = bubble_s(name.removesuffix(BLOCKING), pp, m, t_f, t_b, t_w)
            busiest = max(range(pp), key=lambda rk: med[(name, rk)]["compute"])
            measured, step = med[(name, busiest)]["idle"], max(med[(name, rk)]["step"] for rk in range(pp))
            predicted.append(
                f"| {m} | {name} | {t_f * 1e3:.1f}, {t_b * 1e3:.1f}, {t_w * 1e3:.1f} | {guess * 1e3:.1f} "
                f"| {measured * 1e3:.1f} (rank {busiest}) | {(guess - measured) / step:+.3f} |"
            )
        idle = {name: sum(med[(name, rk)]["idle"] for rk in range(pp)) / pp for name in names}
        step = {name: max(med[(name, rk)]["step"] for rk in range(pp)) for name in names}
        pairs = [(baseline(name), name) for name in names if name != baseline(name)]  # each against 1F1B
        pairs += [(name + BLOCKING, name) for name in names if name + BLOCKING in names]  # blocking -> async sends
        for base, name in pairs:
            saved_idle, saved_step = idle[base] - idle[name], step[base] - step[name]
            verdict = (
                f"m {m}, {base} -> {name}: idle per rank (mean of the {pp}) {idle[base] * 1e3:.1f} -> "
                f"{idle[name] * 1e3:.1f} ms (x{idle[name] / idle[base]:.2f}); step {step[base] * 1e3:.1f} -> "
                f"{step[name] * 1e3:.1f} ms ({saved_step * 1e3:+.1f} ms faster"
            )
            verdicts.append(verdict + (f", for {saved_idle * 1e3:.1f} ms of idle saved)" if saved_idle > 0 else ")"))
    return "\n".join(lines) + "\n\n" + "\n".join(predicted), verdicts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages, one process each")
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--shapes", nargs="+", default=["512x64", "256x128"], help="hidden x sequence, one run each")
    ap.add_argument(
        "--blocking",
        action="store_true",
        help="also run 1F1B and ZB-H1 with DeepSpeed's blocking sends (interleaved); not ZB-H2, whose order is "
        "built for async sends",
    )
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    load_start = os.getloadavg()[0]
    sections = []
    with OtherWork() as other:
        for shape in args.shapes:
            hidden, seq = (int(v) for v in shape.split("x"))
            ranks = sorted(
                run(args.micro_batches, args.repeats, hidden, seq, args.pp, args.blocking), key=lambda r: r["pp_rank"]
            )
            names = tuple(dict.fromkeys(row["schedule"] for row in ranks[0]["rows"]))  # what the worker ran, in order
            body, verdicts = table(ranks, args.micro_batches, names)
            sections.append(f"**h {hidden}, s {seq}**\n\n{body}\n\n" + "\n".join(f"- {v}" for v in verdicts))
    cores = os.cpu_count() or 1
    noisy = (
        " (the schedules, interleaved, saw the same noise)"
        if other.cores <= 0.2
        else ": other jobs shared the cores and the times are noisy (the schedules, interleaved, saw the same noise)"
    )
    crowded = f" (oversubscribed: {args.pp} processes on {cores} cores)" if args.pp > cores else ""
    text = (
        f"pp {args.pp} on {args.pp} CPU processes{crowded} (gloo, 1 thread each), GPT-2 (tied embeddings) "
        f"{2 * args.pp} layers, 8 heads, micro-batch 2, fp32; median (min-max) of {args.repeats} repeats after one "
        f"warm-up (where ZB-H2 times its passes and rebuilds its order), {', '.join(names)} and every m "
        f"interleaved in each repeat.  Compute = forward, B, W and loading; idle = blocked in the pipeline's receives "
        f"and (async) sends, in the wait for those sends to complete and in the tied-embedding all-reduce that ends "
        f"the step (where the stage done first waits).  "
        f"Load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {cores} cores; other "
        f"work on the machine kept {other.cores:.2f} cores busy on average (its busy CPU time minus this "
        f"benchmark's){noisy}.\n\n" + "\n\n".join(sections)
    )
    print(text)
    if args.markdown:
        command = (
            f"python benchmarks/zero_bubble.py --pp {args.pp} --repeats {args.repeats} "
            f"--micro-batches {' '.join(map(str, args.micro_batches))} --shapes {' '.join(args.shapes)}"
            + " --blocking"
            * args.blocking
        )
        title = f"Zero-bubble (ZB-H1, ZB-H2) against 1F1B: pipeline idle time at pp {args.pp}"
        write_markdown(args.markdown, title, command, text)


if __name__ == "__main__":
    main()
