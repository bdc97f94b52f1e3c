"""Pipeline idle time of one training step, DeepSpeed's 1F1B against ZB-H1, measured per rank at pp 2.

    python benchmarks/zero_bubble.py [--micro-batches 4 8 16] [--repeats 7] [--markdown OUT.md]

Two processes under the deepspeed launcher (CPU, gloo, one thread each), a GPT-2 of 4 layers (2 per stage), h 256,
8 heads, s 128, micro-batch 2, fp32.  Every instruction of a step is timed on every rank (the worker is
tests/workers/zero_bubble.py): compute (forward, B, W, loading a micro-batch), waiting (the pipeline's sends and
receives, which block until the other stage is ready: the bubble), and the step's reductions and optimizer.  The two
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


def run(micro_batches: list[int], repeats: int) -> list[dict]:
    """Every rank's rows: one per (repeat, m, schedule) with seconds of compute, wait, step work and the step."""
    with tempfile.TemporaryDirectory() as out:
        args = ["--out", out, "--measure", "--repeats", str(repeats), "--micro-batches", *map(str, micro_batches)]
        deepspeed_launch(WORKERS / "zero_bubble.py", 2, args, timeout=1800)
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("measure.rank*.json"))]


def spread(values: list[float]) -> str:
    """Median (min-max) in ms."""
    ms = [v * 1e3 for v in values]
    return f"{statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f})"


def table(ranks: list[dict], micro_batches: list[int]) -> tuple[str, list[str]]:
    lines = [
        "| m | schedule | rank | compute (ms) | waiting (ms) | reductions + step (ms) | step (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for m in micro_batches:
        med = {}
        for name in SCHEDULES:
            for r in ranks:
                rows = [row for row in r["rows"] if row["m"] == m and row["schedule"] == name]
                cols = {k: [row[k] for row in rows] for k in ("compute", "wait", "step", "step_total")}
                med[(name, r["pp_rank"])] = {k: statistics.median(v) for k, v in cols.items()}
                lines.append(
                    f"| {m} | {name} | {r['pp_rank']} | {spread(cols['compute'])} | {spread(cols['wait'])} "
                    f"| {spread(cols['step'])} | {spread(cols['step_total'])} |"
                )
        idle = {name: sum(med[(name, rk)]["wait"] for rk in (0, 1)) / 2 for name in SCHEDULES}
        step = {name: max(med[(name, rk)]["step_total"] for rk in (0, 1)) for name in SCHEDULES}
        saved_idle, saved_step = idle["1f1b"] - idle["zb-h1"], step["1f1b"] - step["zb-h1"]
        verdicts.append(
            f"m {m}: mean idle per rank {idle['1f1b'] * 1e3:.1f} -> {idle['zb-h1'] * 1e3:.1f} ms "
            f"(x{idle['zb-h1'] / idle['1f1b']:.2f}); step {step['1f1b'] * 1e3:.1f} -> {step['zb-h1'] * 1e3:.1f} ms, "
            f"{saved_step * 1e3:.1f} ms of the {saved_idle * 1e3:.1f} ms of idle saved "
            f"({saved_step / saved_idle:.0%})"
            if saved_idle > 0
            else f"m {m}: idle not reduced ({idle['1f1b'] * 1e3:.1f} -> {idle['zb-h1'] * 1e3:.1f} ms)"
        )
    return "\n".join(lines), verdicts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    ranks = sorted(run(args.micro_batches, args.repeats), key=lambda r: r["pp_rank"])
    body, verdicts = table(ranks, args.micro_batches)
    text = (
        f"pp 2 on 2 CPU processes (gloo, 1 thread each), GPT-2 4 layers h 256 a 8 s 128, micro-batch 2, fp32; "
        f"median (min-max) of {args.repeats} repeats after one warm-up, 1f1b and zb-h1 and every m interleaved "
        f"in each repeat.  Waiting = time blocked in the pipeline's sends and receives (the bubble); compute = "
        f"forward, B, W and loading; the step's tied/data-parallel reductions and optimizer are apart.  "
        f"The machine's {os.cpu_count()} cores are shared with other jobs (other agents ran tests meanwhile), "
        f"so absolute times are noisy; the schedules, interleaved, saw the same noise.\n\n"
        f"{body}\n\n" + "\n".join(f"- {v}" for v in verdicts)
    )
    print(text)
    if args.markdown:
        command = f"python benchmarks/zero_bubble.py --repeats {args.repeats}"
        write_markdown(args.markdown, "Zero-bubble (ZB-H1) against 1F1B: pipeline idle time at pp 2", command, text)


if __name__ == "__main__":
    main()
