"""Step time with the data-parallel gradient reduction overlapped (``parallel.overlap_grad_reduce``) against
DeepSpeed's reduction after the step, at dp 2.

    python benchmarks/dp_overlap.py [--accumulation 2 8] [--repeats 7] [--hidden 512] [--layers 4] [--seq 128]
        [--markdown OUT]

Two CPU processes under the deepspeed launcher (gloo, one thread each), a GPT-2 of ``--layers`` blocks, 8 heads,
micro-batch 2, fp32 (ZeRO 0), buckets of the package's size.  Every (accumulation, off/on) engine is built first and
the runs are interleaved within each repeat, so machine noise hits them alike; the first round (which also teaches
the overlap the step's instruction stream) is dropped.  Per rank and step: wall seconds, the process's CPU seconds
(every thread, gloo's included) and the seconds spent in ``ReduceGrads`` (with the overlap: the wait for reductions
started during the last backward; without: DeepSpeed's whole reduction).  The worker is tests/workers/grad_overlap.py.
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


def run(args) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        worker = ["--out", out, "--measure", "--repeats", str(args.repeats), "--accumulation"]
        worker += [*map(str, args.accumulation), "--hidden", str(args.hidden), "--layers", str(args.layers)]
        worker += ["--seq", str(args.seq)]
        deepspeed_launch(WORKERS / "grad_overlap.py", 2, worker, timeout=3000)
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("measure.rank*.json"))]


def ms(values: list[float]) -> str:
    """Median (min-max) in ms."""
    v = [x * 1e3 for x in values]
    return f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"


def table(ranks: list[dict], accumulation: list[int]) -> str:
    lines = [
        "| accumulation | overlap | step ms (rank 0) | step ms (rank 1) | ReduceGrads ms (rank 0) | CPU s per step "
        "(rank 0) | step on / off |",
        "|---|---|---|---|---|---|---|",
    ]
    for gas in accumulation:
        medians = {}
        for overlap in (False, True):
            per_rank = [[r for r in rank["rows"] if r["gas"] == gas and r["overlap"] == overlap] for rank in ranks]
            step = [max(rows[i]["step"] for rows in per_rank) for i in range(len(per_rank[0]))]  # the slower rank
            medians[overlap] = statistics.median(step)
            ratio = f"{medians[True] / medians[False]:.3f}" if overlap else ""
            cpu = statistics.median(r["cpu"] for r in per_rank[0])
            lines.append(
                f"| {gas} | {'on' if overlap else 'off'} | {ms([r['step'] for r in per_rank[0]])} | "
                f"{ms([r['step'] for r in per_rank[1]])} | {ms([r['reduce'] for r in per_rank[0]])} | {cpu:.3f} | "
                f"{ratio} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--accumulation", type=int, nargs="*", default=[2, 8])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    load_before = os.getloadavg()
    with OtherWork() as other:
        ranks = run(args)
    load_after = os.getloadavg()
    body = table(ranks, args.accumulation)
    body += (
        f"\n\n{ranks[0]['params']:,} parameters; medians (min-max) over {args.repeats} repeats; 'step on / off' is the "
        "ratio of the medians of the slower rank's step.  Load average (1, 5, 15 min) before "
        f"{', '.join(f'{x:.2f}' for x in load_before)}, after {', '.join(f'{x:.2f}' for x in load_after)}; other "
        f"work on the machine during the run: {other.cores:.2f} cores."
    )
    print(body)
    if args.markdown:
        command = "python benchmarks/dp_overlap.py " + " ".join(sys.argv[1:])
        write_markdown(args.markdown, "Overlapped data-parallel reduction, dp 2 (CPU, gloo)", command, body)


if __name__ == "__main__":
    main()
