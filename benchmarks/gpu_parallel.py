"""The multi-GPU half of benchmarks/gpu_check.sh: the loss of tp 2 with sequence parallelism (and, on 4 GPUs, tp 2 x
pp 2 and tp 2 x cp 2) against tp 1 on one GPU, over NCCL, and the step time of each.

    python benchmarks/gpu_parallel.py --layout 1,1,1 --rows ROWS.jsonl                       (the reference, 1 GPU)
    deepspeed --num_gpus 2 benchmarks/gpu_parallel.py --layout 2,1,1,sp --rows ROWS.jsonl    (one launch per layout)
    python benchmarks/gpu_parallel.py --table ROWS.jsonl [--markdown OUT.md]                 (appends the table)

A layout is tp,pp,cp (dp is 1: every layout sees the same micro-batches), ``sp`` for sequence parallelism.  The
model is gpu_step.py's (GPT-3 1.3B shape, bf16, ZeRO-1, sdpa, no recompute) with 4 layers and dropout 0, so that
every layout computes the same function: the losses differ only by bf16 rounding of differently ordered sums, and
``--tolerance`` (absolute, per step) flags a layout whose loss moves further (a missing or doubled reduction moves
it by far more).  ``--tiny`` runs the same on CPU (gloo) at gpu_step.py's tiny shape, as the unit of the launcher
tier that keeps this script from rotting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import gpu_step  # noqa: E402

from ds_megatron.config import resolve  # noqa: E402
from ds_megatron.data import MicroBatchStream, PackedSamples  # noqa: E402
from ds_megatron.engine import build_engine  # noqa: E402

REFERENCE = "1,1,1"


def parse_layout(text: str) -> dict:
    """``"2,2,1,sp"`` -> tp 2, pp 2, cp 1 with sequence parallelism."""
    parts = text.split(",")
    if len(parts) not in (3, 4) or not all(p.isdigit() for p in parts[:3]) or parts[3:] not in ([], ["sp"]):
        raise SystemExit(f"gpu_parallel: --layout {text!r} is not tp,pp,cp[,sp] (e.g. 2,1,1,sp)")
    tp, pp, cp = map(int, parts[:3])
    return {"tp": tp, "pp": pp, "cp": cp, "sequence_parallel": parts[3:] == ["sp"]}


def ds_config(args, layout: dict) -> dict:
    config = gpu_step.ds_config(args, "none", "sdpa")
    config["ds_megatron"]["model"]["dropout"] = 0.0
    config["ds_megatron"]["parallel"] = dict(layout)
    return config


def run_layout(args, text: str) -> dict:
    """Train ``args.warmup + args.steps`` steps at the layout: every step's loss, the median measured step time."""
    layout = parse_layout(text)
    world = layout["tp"] * layout["pp"] * layout["cp"]
    run = resolve(ds_config(args, layout), world)
    built = build_engine(run)
    engine, topo = built.engine, built.topology
    cuda = torch.cuda.is_available()
    tokens = torch.randint(0, args.vocab, (args.seq * 64,), generator=torch.Generator().manual_seed(0))
    samples = PackedSamples(tokens, args.seq, seed=0)
    stream = MicroBatchStream(samples, args.micro_batch, 1, topo.dp_rank, run.dp, 0, topo.cp_rank, topo.cp)
    losses, times = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        losses.append(float(engine.train_batch(stream)))
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return {
        "layout": text,
        "gpus": world,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "losses": losses,
        "step_ms": 1000 * statistics.median(times),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }


def table(rows: list[dict], tolerance: float) -> tuple[str, bool]:
    """The markdown table of every layout against the reference's losses, and whether every layout is within
    ``tolerance``.  A missing reference or layout row (a run that died) is a failure, named in the table."""
    by_layout = {row["layout"]: row for row in rows}
    ref = by_layout.get(REFERENCE)
    lines = [
        f"Loss parity with tp 1 on one GPU ({len(ref['losses']) if ref else '?'} steps, tolerance {tolerance} per "
        "step) and step time, one process per GPU (deepspeed launcher).",
        "",
        "| layout (tp,pp,cp) | GPUs | max abs loss diff vs tp 1 | parity | step (ms) | step vs tp 1 | peak mem (GiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    if ref is None:
        return "\n".join([*lines, f"| {REFERENCE} | 1 | reference missing (its run failed) | FAIL | | | |"]), False
    ok = True
    for row in rows:
        diff = max(abs(a - b) for a, b in zip(row["losses"], ref["losses"], strict=True))
        passed = diff <= tolerance
        ok &= passed
        peak = "n/a" if row["peak_gib"] is None else f"{row['peak_gib']:.2f}"
        lines.append(
            f"| {row['layout']} | {row['gpus']} | {diff:.2e} | {'ok' if passed else 'FAIL'} | {row['step_ms']:.1f} | "
            f"{row['step_ms'] / ref['step_ms']:.2f}x | {peak} |"
        )
    return "\n".join(lines), ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", help="tp,pp,cp[,sp] to train (under the deepspeed launcher when it spans GPUs)")
    ap.add_argument("--rows", help="append this run's row (JSON lines) to this file")
    ap.add_argument("--table", help="the rows file to compare and print")
    ap.add_argument("--expect", nargs="*", default=[], help="layouts the table must hold (a missing one fails)")
    ap.add_argument("--markdown", help="append the table to this markdown file")
    ap.add_argument("--tolerance", type=float, default=0.05, help="largest absolute loss difference per step")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: gpu_step.py's tiny shape, 2 steps")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    args.hidden, args.heads, args.seq, args.vocab = 2048, 16, 2048, 50257
    if args.tiny:
        args.layers, args.hidden, args.heads, args.seq, args.vocab = 2, 64, 4, 32, 300
        args.warmup, args.steps = 1, 1
    if args.table:
        rows = [json.loads(line) for line in open(args.table)] if os.path.exists(args.table) else []
        text, ok = table(rows, args.tolerance)
        missing = sorted(set(args.expect) - {row["layout"] for row in rows})
        if missing:
            text += f"\n\nNo result for {', '.join(missing)}: the run failed or ran out of time (see its log)."
            ok = False
        print(text, flush=True)
        if args.markdown:
            with open(args.markdown, "a") as f:
                f.write(f"\n## Multi-GPU parity\n\n{text}\n")
        raise SystemExit(0 if ok else 1)
    if not args.layout:
        raise SystemExit("gpu_parallel: pass --layout tp,pp,cp[,sp] or --table ROWS")
    row = run_layout(args, args.layout)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(row), flush=True)
        if args.rows:
            with open(args.rows, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
