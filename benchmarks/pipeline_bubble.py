"""The pipeline bubble, measured: per rank, the time of one training step spent computing (forward and backward
passes, and the deferred W passes of ``dualpipev-zb``) and the time spent blocked on a peer (the step's time outside
computing, data loading and the optimizer: receives, DualPipeV's batched p2p commits (which wait for their receives),
the sends (async, ``parallel.p2p``) and the wait for them to complete at the step's first reduction, the
tied-embedding sync and the loss broadcast), for 1F1B, DualPipeV and DualPipeV with deferred weight gradients
(``dualpipev-zb``) at m = 4, 8 and 16 micro-batches, pp 2 on 2 CPU processes (gloo, one thread each).

    python benchmarks/pipeline_bubble.py [--repeats 5] [--blocking] [--markdown OUT.md]

Runs itself under the deepspeed launcher.  The 9 engines are built once; each repeat then runs one step of every
(m, schedule) in turn, so a slower moment of a shared machine falls on all of them alike.  Each step starts after a
barrier.  Idle fraction = blocked / (computing + blocked); the data load, gradient reduction and optimizer step (the
same under every schedule) are left out.  Next to each measured idle fraction: the tuner's prediction for p equal
stages (``tune.training.schedules``: 1F1B's bubble (p-1)/(m+p-1) of the step, DualPipeV's simulated makespan, and
``pipeline_parallel.schedules.dualpipev_zb``'s with its W passes deferred).

The model keeps its stages balanced, as the formula assumes: 8 blocks of width 256 and a 1024-token vocabulary
(the output layer costs about a third of a block), so each 1F1B stage holds 4 blocks and the embedding or the
output layer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ds_megatron.pipeline_parallel.schedules import dualpipev_zb  # noqa: E402
from ds_megatron.pipeline_parallel.schedules.dualpipev import COSTS as DUALPIPEV_COSTS  # noqa: E402
from ds_megatron.pipeline_parallel.schedules.dualpipev import slots as dualpipev_slots  # noqa: E402
from ds_megatron.tune.training.schedules import bubble_s  # noqa: E402

MICRO_BATCHES = (4, 8, 16)
SCHEDULES = ("1f1b", "dualpipev", "dualpipev-zb")
BLOCKING = "+blocking"  # a schedule run with DeepSpeed's blocking sends (``--blocking``), interleaved with the rest
PP = 2


def config(schedule: str, m: int) -> dict:
    return {
        "train_batch_size": 2 * m,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": m,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "ds_megatron": {
            "model": {
                "num_layers": 8,
                "hidden_size": 256,
                "num_heads": 4,
                "vocab_size": 1024,
                "seq_length": 128,
                "dropout": 0.0,
                "attention": "eager",  # the kernel its recorded results were measured with
            },
            "parallel": {"tp": 1, "pp": PP, "pipeline_schedule": schedule},
            "train": {"seed": 1234, "train_iters": 1},
        },
    }


def timed_step(run, engine, totals: dict, m: int, micro_batch: int, g) -> dict:
    """One training step of ``m`` random micro-batches after a barrier: ``instrument``'s totals for it, with the
    step's wall seconds and its wait (the step outside computing and local work)."""
    import torch
    import torch.distributed as dist

    tokens = torch.randint(0, run.model.vocab_size, (m, micro_batch, run.model.seq_length + 1), generator=g)
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    totals.update(compute=0.0, local=0.0, other=0.0)
    dist.barrier()
    t0 = time.perf_counter()
    engine.train_batch(iter(batches))
    step = time.perf_counter() - t0
    return {**totals, "step": step, "wait": step - totals["compute"] - totals["local"]}


def instrument(engine) -> dict[str, float]:
    """Time the instructions of ``engine`` that work alone into the returned totals (zero them before a step):
    forward, backward and W passes ("compute"), and the data load, gradient reduction and optimizer step ("local",
    nothing to reduce at dp 1).  The rest of a step is spent waiting for a peer: sends, receives, DualPipeV's p2p
    commits, the wait for the step's async sends (at ``ReduceTiedGrads``, or after the schedule), the tied
    embedding's gradient exchange between the first and last stage (a pipeline-wide sync: under 1F1B the last
    stage's trailing idle time lands there) and the loss broadcast."""
    totals = {"compute": 0.0, "local": 0.0, "other": 0.0}
    from deepspeed.runtime.pipe import schedule as s

    from ds_megatron.pipeline_parallel.zero_bubble import WeightGradPass

    kinds = {s.ForwardPass: "compute", s.BackwardPass: "compute", WeightGradPass: "compute"}
    kinds.update({s.LoadMicroBatch: "local", s.ReduceGrads: "local", s.OptimizerStep: "local"})
    table = dict(engine._INSTRUCTION_MAP)

    def timed(fn, kind):
        def run(self, **kwargs):
            t0 = time.perf_counter()
            fn(self, **kwargs)
            totals[kind] += time.perf_counter() - t0

        return run

    engine._INSTRUCTION_MAP = {cls: timed(fn, kinds.get(cls, "other")) for cls, fn in table.items()}
    return totals


def worker(out: str, repeats: int, names: tuple[str, ...]) -> None:
    import torch

    from ds_megatron.config import resolve
    from ds_megatron.engine import build_engine
    from ds_megatron.pipeline_parallel.p2p import BlockingSends

    engines = {}
    for m in MICRO_BATCHES:
        for schedule in names:
            run = resolve(config(schedule.removesuffix(BLOCKING), m), int(os.environ["WORLD_SIZE"]))
            engine = build_engine(run).engine
            if schedule.endswith(BLOCKING):
                engine.pending_sends = BlockingSends()
            engines[(schedule, m)] = (run, engine, instrument(engine))
    g = torch.Generator().manual_seed(0)
    rows = []
    for repeat in range(repeats + 1):  # the first round warms up (allocations, first p2p shape exchange)
        for m in MICRO_BATCHES:
            for schedule in names:
                run, engine, totals = engines[(schedule, m)]
                step = timed_step(run, engine, totals, m, 2, g)
                if repeat:
                    rows.append({"schedule": schedule, "m": m, "repeat": repeat, **step})
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(rows))


def summarise(rows_by_rank: dict[int, list[dict]], names: tuple[str, ...]) -> str:
    lines = [
        "| schedule | m | rank | idle fraction (median [min, max]) | computing ms | blocked ms | step ms |",
        "|---|---|---|---|---|---|---|",
    ]
    means, steps = {}, {}
    for m in MICRO_BATCHES:
        for schedule in names:
            per_rank, step_ms = [], []
            for rank, rows in sorted(rows_by_rank.items()):
                mine = [r for r in rows if r["schedule"] == schedule and r["m"] == m]
                idle = [r["wait"] / (r["compute"] + r["wait"]) for r in mine]
                per_rank.append(statistics.median(idle))
                med = {k: 1e3 * statistics.median(r[k] for r in mine) for k in ("compute", "wait", "step")}
                step_ms.append(med["step"])
                lines.append(
                    f"| {schedule} | {m} | {rank} | {statistics.median(idle):.3f} [{min(idle):.3f}, {max(idle):.3f}] "
                    f"| {med['compute']:.0f} | {med['wait']:.0f} | {med['step']:.0f} |"
                )
            means[(schedule, m)] = statistics.mean(per_rank)
            steps[(schedule, m)] = statistics.mean(step_ms)
    lines += [
        "",
        "Mean over the two ranks of the median idle fraction (and of the median step, ms), and the tuner's for equal "
        "stages (pipeline_parallel.schedules):",
        "",
        "| m | 1f1b measured | 1f1b predicted | dualpipev measured | dualpipev predicted | dualpipev-zb measured "
        "| dualpipev-zb predicted |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in MICRO_BATCHES:
        t_f, t_b = DUALPIPEV_COSTS  # the time model's forward : backward (W inside the backward)
        one_f_one_b = bubble_s("1f1b", PP, m, t_f, t_b, 0.0) / (
            m * (t_f + t_b) + bubble_s("1f1b", PP, m, t_f, t_b, 0.0)
        )
        predicted = [one_f_one_b] + [(s - m) / s for s in (dualpipev_slots(PP, m), dualpipev_zb.slots(PP, m))]
        cells = [
            f"{means[(name, m)]:.3f} ({steps[(name, m)]:.0f} ms) | {p:.3f}" for name, p in zip(SCHEDULES, predicted)
        ]
        lines.append(f"| {m} | {' | '.join(cells)} |")
    blocking = [name for name in names if name.endswith(BLOCKING)]
    if blocking:
        lines += [
            "",
            "With DeepSpeed's blocking sends (interleaved with the above): the same mean idle fraction (step).",
            "",
        ]
        lines += ["| m | " + " | ".join(blocking) + " |", "|---|" + "---|" * len(blocking)]
        for m in MICRO_BATCHES:
            cells = [f"{means[(name, m)]:.3f} ({steps[(name, m)]:.0f} ms)" for name in blocking]
            lines.append(f"| {m} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--blocking", action="store_true", help="also each schedule with DeepSpeed's blocking sends")
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--note", default="", help="a line on the machine's load, written under the table")
    ap.add_argument("--worker-out", default=None)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    names = SCHEDULES + tuple(name + BLOCKING for name in SCHEDULES if args.blocking)
    if args.worker_out:
        worker(args.worker_out, args.repeats, names)
        return
    load_start = os.getloadavg()[0]  # the machine's load: a shared machine's numbers say how shared it was
    with tempfile.TemporaryDirectory() as tmp:
        launcher = Path(sys.executable).parent / "deepspeed"
        cmd = [str(launcher), "--num_gpus", str(PP), __file__, "--worker-out", tmp, "--repeats", str(args.repeats)]
        cmd += ["--blocking"] * args.blocking
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        rows = {int(f.stem[4:]): json.loads(f.read_text()) for f in Path(tmp).glob("rank*.json")}
    body = summarise(rows, names)
    load = f"load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    body = f"pp {PP}, gloo, 2 processes x 1 thread, {args.repeats} repeats after one warm-up round; {load}.\n\n{body}"
    if args.note:
        body += f"\n\n{args.note}"
    print(body)
    if args.markdown:
        from _results import write_markdown

        write_markdown(
            args.markdown,
            "Pipeline bubble: 1F1B, DualPipeV and DualPipeV with deferred weight gradients",
            f"python benchmarks/pipeline_bubble.py --repeats {args.repeats}" + " --blocking" * args.blocking,
            body,
        )


if __name__ == "__main__":
    main()
