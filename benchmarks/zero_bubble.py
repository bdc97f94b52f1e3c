"""Pipeline idle time of one training step, DeepSpeed's 1F1B against ZB-H1, measured per rank at pp 2.

    python benchmarks/zero_bubble.py [--micro-batches 4 8 16] [--repeats 7] [--shapes 512x64 256x128] [--markdown OUT]

Two processes under the deepspeed launcher (CPU, gloo, one thread each), a GPT-2 of 4 layers (2 per stage), 8
heads, micro-batch 2, fp32.  Every instruction of a step is timed on every rank (the worker is
tests/workers/zero_bubble.py), at each hidden x sequence shape: compute (forward, B, W, loading a micro-batch),
idle (the pipeline's sends and receives, which block until the other stage is ready, and the tied-embedding
all-reduce where the stage done first waits: the bubble), and the gradient reduction and optimizer.  The two
schedules and every micro-batch count are interleaved within each repeat, so machine noise hits them alike; the
median over the repeats is reported with its range.
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

from _results import write_markdown  # noqa: E402
from launch import WORKERS, deepspeed_launch  # noqa: E402

SCHEDULES = ("1f1b", "zb-h1")


def run(micro_batches: list[int], repeats: int, hidden: int, seq: int) -> list[dict]:
    """Every rank's rows: one per (repeat, m, schedule) with seconds of compute, wait, step work and the step."""
    with tempfile.TemporaryDirectory() as out:
        args = ["--out", out, "--measure", "--repeats", str(repeats), "--micro-batches", *map(str, micro_batches)]
        args += ["--hidden", str(hidden), "--seq", str(seq)]
        deepspeed_launch(WORKERS / "zero_bubble.py", 2, args, timeout=1800)
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("measure.rank*.json"))]


def spread(values: list[float]) -> str:
    """Median (min-max) in ms."""
    ms = [v * 1e3 for v in values]
    return f"{statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f})"


def table(ranks: list[dict], micro_batches: list[int]) -> tuple[str, list[str]]:
    """Per (m, schedule, rank): compute, idle, the optimizer's own work and the step; and one verdict per m.

    Idle is the time blocked in the pipeline's sends and receives plus the tied-embedding all-reduce at the step's
    end (the stage that finishes first waits there for the other: the cooldown bubble lands in it); the all-reduce's
    own transfer is a few milliseconds of that."""
    lines = [
        "| m | schedule | rank | compute (ms) | idle (ms) | grad reduction + optimizer (ms) | step (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for m in micro_batches:
        med = {}
        for name in SCHEDULES:
            for r in ranks:
                rows = [row for row in r["rows"] if row["m"] == m and row["schedule"] == name]
                cols = {
                    "compute": [row["compute"] for row in rows],
                    "idle": [row["wait"] + row.get("ReduceTiedGrads", 0.0) for row in rows],
                    "optimizer": [row.get("ReduceGrads", 0.0) + row.get("OptimizerStep", 0.0) for row in rows],
                    "step": [row["step_total"] for row in rows],
                }
                med[(name, r["pp_rank"])] = {k: statistics.median(v) for k, v in cols.items()}
                lines.append(
                    f"| {m} | {name} | {r['pp_rank']} | {spread(cols['compute'])} | {spread(cols['idle'])} "
                    f"| {spread(cols['optimizer'])} | {spread(cols['step'])} |"
                )
        idle = {name: sum(med[(name, rk)]["idle"] for rk in (0, 1)) / 2 for name in SCHEDULES}
        step = {name: max(med[(name, rk)]["step"] for rk in (0, 1)) for name in SCHEDULES}
        saved_idle, saved_step = idle["1f1b"] - idle["zb-h1"], step["1f1b"] - step["zb-h1"]
        verdict = (
            f"m {m}: idle per rank (mean of the two) {idle['1f1b'] * 1e3:.1f} -> {idle['zb-h1'] * 1e3:.1f} ms "
            f"(x{idle['zb-h1'] / idle['1f1b']:.2f}); step {step['1f1b'] * 1e3:.1f} -> {step['zb-h1'] * 1e3:.1f} ms "
            f"({saved_step * 1e3:+.1f} ms faster"
        )
        verdicts.append(verdict + (f", for {saved_idle * 1e3:.1f} ms of idle saved)" if saved_idle > 0 else ")"))
    return "\n".join(lines), verdicts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--shapes", nargs="+", default=["512x64", "256x128"], help="hidden x sequence, one run each")
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    sections = []
    for shape in args.shapes:
        hidden, seq = (int(v) for v in shape.split("x"))
        ranks = sorted(run(args.micro_batches, args.repeats, hidden, seq), key=lambda r: r["pp_rank"])
        body, verdicts = table(ranks, args.micro_batches)
        sections.append(f"**h {hidden}, s {seq}**\n\n{body}\n\n" + "\n".join(f"- {v}" for v in verdicts))
    text = (
        f"pp 2 on 2 CPU processes (gloo, 1 thread each), GPT-2 (tied embeddings) 4 layers, 8 heads, micro-batch 2, "
        f"fp32; median (min-max) of {args.repeats} repeats after one warm-up, 1f1b and zb-h1 and every m "
        f"interleaved in each repeat.  Compute = forward, B, W and loading; idle = blocked in the pipeline's sends "
        f"and receives and in the tied-embedding all-reduce that ends the step (where the stage done first waits).  "
        f"The machine's {os.cpu_count()} cores were shared with other jobs (other agents' tests and benchmarks; "
        f"load average 20-50 during the runs), so times are noisy; the schedules, interleaved, saw the same "
        f"noise.\n\n" + "\n\n".join(sections)
    )
    print(text)
    if args.markdown:
        command = f"python benchmarks/zero_bubble.py --repeats {args.repeats} --shapes {' '.join(args.shapes)}"
        write_markdown(args.markdown, "Zero-bubble (ZB-H1) against 1F1B: pipeline idle time at pp 2", command, text)


if __name__ == "__main__":
    main()
