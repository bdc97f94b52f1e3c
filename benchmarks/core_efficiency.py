"""Step time of the core path before and after a change, interleaved (before, after, before, after, ...) so that
machine noise hits both alike.

    python benchmarks/core_efficiency.py --before DIR [--reps 3] [--iters 12] [--markdown OUT.md]

``--before`` is a checkout of the older commit (e.g. ``git worktree add /tmp/before <commit>``); the current tree is
"after".  Each run is the recipe under the deepspeed launcher on CPU processes (gloo, OMP_NUM_THREADS=1) with the
demo config; the step time is the median of the logged per-step times after the first 3 steps.  Layouts: the demo
(tp 2 x pp 2, SP, selective recompute, 4 processes) and tp 2 with SP off and on (2 processes, the larger shape of
the efficiency review: 4 layers, h 256, s 256, micro-batch 4).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

AFTER = Path(__file__).resolve().parent.parent
REVIEW_SHAPE = [
    "--set", "ds_megatron.model.num_layers=4", "--set", "ds_megatron.model.hidden_size=256",
    "--set", "ds_megatron.model.num_heads=8", "--set", "ds_megatron.model.seq_length=256",
    "--set", "train_micro_batch_size_per_gpu=4", "--set", "gradient_accumulation_steps=4",
    "--set", "train_batch_size=16",
]  # fmt: skip
LAYOUTS = {  # name: (processes, flags)
    "demo: tp 2 x pp 2, SP, selective": (4, []),
    "tp 2, SP off": (2, ["--tp", "2", "--pp", "1", "--no-sequence-parallel", "--recompute", "none", *REVIEW_SHAPE]),
    "tp 2, SP on": (2, ["--tp", "2", "--pp", "1", "--sequence-parallel", "--recompute", "none", *REVIEW_SHAPE]),
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_ms(tree: Path, nprocs: int, flags: list[str], iters: int, work: Path) -> float:
    run_dir = Path(tempfile.mkdtemp(dir=work))
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(nprocs), "--master_port", str(_port())]
    cmd += ["recipes/train_gpt.py", "--deepspeed_config", "ds_configs/gpt_tiny.json", "--train-iters", str(iters)]
    cmd += ["--log-interval", "1", "--set", f"ds_megatron.logging.run_dir={run_dir}"]
    cmd += ["--set", f"ds_megatron.data.cache_dir={work / 'cache'}", "--set", "ds_megatron.train.generate_tokens=0"]
    cmd += ["--set", "ds_megatron.logging.wandb_project=null", "--set", "ds_megatron.train.eval_iters=1", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree), WANDB_MODE="offline", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: {' '.join(flags)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_ms"] for r in records if "step_ms" in r][3:]
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="checkout of the commit to compare against")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--markdown")
    args = ap.parse_args()
    before = Path(args.before).resolve()
    work = Path(tempfile.mkdtemp(prefix="core_eff_"))
    results: dict[tuple[str, str], list[float]] = {}
    for rep in range(args.reps):
        for name, (nprocs, flags) in LAYOUTS.items():
            for label, tree in (("before", before), ("after", AFTER)):
                ms = step_ms(tree, nprocs, flags, args.iters, work)
                results.setdefault((name, label), []).append(ms)
                print(f"rep {rep}: {name:<36} {label:<6} {ms:8.1f} ms/step", flush=True)
    lines = [
        "| layout | before (ms/step) | after (ms/step) | before / after |",
        "|---|---|---|---|",
    ]
    med = {k: statistics.median(v) for k, v in results.items()}
    for name in LAYOUTS:
        b, a = med[(name, "before")], med[(name, "after")]
        lines.append(f"| {name} | {b:.1f} | {a:.1f} | **{b / a:.2f}x** |")
    for label in ("before", "after"):
        on, off = med[("tp 2, SP on", label)], med[("tp 2, SP off", label)]
        lines.append(f"\nSP on / SP off at tp 2, {label}: {on:.1f} / {off:.1f} = **{on / off:.2f}**")
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=before, capture_output=True, text=True)
        header = (
            f"# Core path step time, before and after\n\n{datetime.date.today().isoformat()}, {platform.machine()} "
            f"({os.cpu_count()} cores), torch {torch.__version__}, CPU processes with gloo (no reduce-scatter: "
            f"emulated by all-reduce + slice), OMP_NUM_THREADS=1, medians of {args.reps} interleaved runs x "
            f"{args.iters - 3} steps; before = {rev.stdout.strip()}.\n"
            "`python benchmarks/core_efficiency.py --before <checkout>`\n\n"
        )
        Path(args.markdown).write_text(header + table + "\n")


if __name__ == "__main__":
    main()
