"""Interleaved 1F1B's bubble, measured: per rank, the idle fraction of one training step (time blocked on a peer over
computing plus blocked, ``pipeline_bubble.instrument``'s split of the step) at pp 2 and 4, m = 4 and 8 micro-batches
and v = 1, 2, 4 model chunks per rank (v 1: plain 1F1B, DeepSpeed's own schedule), next to the record's simulated
bubble (``interleaved_1f1b``'s ``bubble``: (p - 1)(T_F + T_B) / v of fill and drain over an ideal m (T_F + T_B)).

    python benchmarks/interleaved_bubble.py [--repeats 3] [--block-ms 20] [--markdown OUT.md] [--rows OUT.json]
    python benchmarks/interleaved_bubble.py --from-rows OUT.json [--markdown OUT.md]   (the tables again)

Runs itself under the deepspeed launcher, once per pipeline size (p processes, gloo, one thread each).

Method: a block's compute is a fixed wall-clock cost that does not hold a core.  Each of the 16 transformer blocks
(width 64, 32 tokens: a few hundred microseconds of arithmetic) sleeps ``--block-ms`` in its forward and twice that
in its backward (``Clock``), as a GPU kernel keeps the device, not the host, busy.  On a machine with fewer cores
than ranks (pp 4 on 2 cores) a compute-bound block would make every rank wait for a core, and the measured idle
time would be the scheduler's, not the pipeline's; with sleeping blocks the ranks overlap as GPUs do, and what the
step spends outside the passes is the schedule's bubble plus the cost of communication and DeepSpeed's instruction
dispatch.  The blocks are cut into v p stages of 16 / (v p) each (DeepSpeed's ``type:BlockPipe`` partitioning), so
a chunk costs 1/v of a 1F1B stage, the simulator's model: T_F = 16 / p blocks' forward sleep and T_B = 2 T_F per
stage.  The embedding and the output layer (vocabulary 256) cost next to nothing, so the stages stay balanced.

Each repeat runs one step of every (m, v) in turn after a barrier, so a slower moment of a shared machine falls on
all of them alike; the first round warms up.  Idle fraction = blocked / (computing + blocked), the data load,
gradient reduction and optimizer step left out, over the rank's own step (``pipeline_bubble``'s) and over the
pipeline's span (the slowest rank's step of that repeat: the simulator's bubble is every rank's idle time up to the
makespan; see ``summarise``).  The predicted idle fraction is b / (1 + b) for the simulated bubble
b = bubble / (m (T_F + T_B)), and the predicted step m (T_F + T_B) + bubble counts the sleeps alone.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_bubble import instrument, timed_step  # noqa: E402

from ds_megatron.pipeline_parallel.schedules import interleaved_1f1b  # noqa: E402

PIPELINES = (2, 4)
MICRO_BATCHES = (4, 8)
CHUNKS = (1, 2, 4)  # v; 1 runs "1f1b"
BLOCKS = 16  # divisible by every v p


def config(p: int, m: int, v: int) -> dict:
    parallel = {"tp": 1, "pp": p, "pipeline_schedule": "1f1b" if v == 1 else interleaved_1f1b.NAME}
    if v > 1:
        parallel[interleaved_1f1b.SETTING] = v
    return {
        "train_batch_size": m,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": m,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "ds_megatron": {
            "model": {
                "num_layers": BLOCKS,
                "hidden_size": 64,
                "num_heads": 4,
                "vocab_size": 256,
                "seq_length": 32,
                "dropout": 0.0,
                "attention": "eager",
            },
            "parallel": parallel,
            "train": {"seed": 1234, "train_iters": 1},
        },
    }


def stage_costs(p: int, block_s: float) -> tuple[float, float]:
    """(T_F, T_B) of one of p stages, seconds: its 16 / p blocks' sleeps."""
    return BLOCKS / p * block_s, BLOCKS / p * 2 * block_s


def predicted(p: int, m: int, v: int, block_s: float) -> tuple[float, float]:
    """(idle fraction, step seconds) of the record's simulator at this step's stage costs."""
    t_f, t_b = stage_costs(p, block_s)
    bubble = interleaved_1f1b.SCHEDULE.at_stages(v).bubble(p, m, t_f, t_b, 0.0)
    ideal = m * (t_f + t_b)
    return bubble / (ideal + bubble), ideal + bubble


def clock_blocks(block_s: float) -> None:
    """Every ``BlockPipe`` of this process sleeps ``block_s`` in its forward and ``2 block_s`` in its backward."""
    import torch

    from ds_megatron.pipeline_parallel.module import BlockPipe

    class Clock(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep(block_s)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            time.sleep(2 * block_s)
            return grad

    plain = BlockPipe.forward

    def forward(self, inputs):
        if isinstance(inputs, tuple):
            return plain(self, (Clock.apply(inputs[0]), *inputs[1:]))
        return plain(self, Clock.apply(inputs))

    BlockPipe.forward = forward


def worker(out: str, repeats: int, block_s: float) -> None:
    import torch

    from ds_megatron.config import resolve
    from ds_megatron.engine import build_engine

    clock_blocks(block_s)
    p = int(os.environ["WORLD_SIZE"])
    engines = {}
    for m in MICRO_BATCHES:
        for v in CHUNKS:
            run = resolve(config(p, m, v), p)
            engine = build_engine(run).engine
            engines[(m, v)] = (run, engine, instrument(engine))
    g = torch.Generator().manual_seed(0)
    rows = []
    for repeat in range(repeats + 1):  # the first round warms up (allocations, first p2p shape exchange)
        for m in MICRO_BATCHES:
            for v in CHUNKS:
                run, engine, totals = engines[(m, v)]
                step = timed_step(run, engine, totals, m, 1, g)
                if repeat:
                    rows.append({"p": p, "m": m, "v": v, "repeat": repeat, **step})
    Path(out, f"pp{p}.rank{os.environ['RANK']}.json").write_text(json.dumps(rows))


def summarise(rows_by_rank: dict[tuple[int, int], list[dict]], block_s: float) -> str:
    """Per (pp, m, v), the mean over ranks of each rank's median idle fraction two ways.  Over the rank's own step
    (``pipeline_bubble``'s): the optimizer step is "local" time, but gradient clipping's norm all-reduce inside it
    waits for the slowest rank, so a rank whose last pass ends before the others' (a middle rank under 1F1B) counts
    their drain as local, not idle.  Over the pipeline's span: the slowest rank's step in that repeat (every rank
    started at the barrier: the simulator's bubble is every rank's idle time up to the makespan) less the least
    local time of any rank in it (the data load, reductions and optimizer step of the rank that waited least in
    them; the ranks' optimizers do about the same work), so that drain counts as idle on every rank."""
    lines = [
        "| pp | m | v | idle, own step: mean (per rank) | idle, pipeline span: mean (per rank) | predicted "
        "| step ms measured | predicted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in PIPELINES:
        ranks = sorted(r for pp, r in rows_by_rank if pp == p)
        for m in MICRO_BATCHES:
            for v in CHUNKS:
                mine = {r: [x for x in rows_by_rank[(p, r)] if x["m"] == m and x["v"] == v] for r in ranks}
                repeats = range(len(mine[ranks[0]]))
                spans = [max(mine[r][i]["step"] for r in ranks) for i in repeats]
                local = [min(mine[r][i]["local"] for r in ranks) for i in repeats]
                own, span = [], []
                for r in ranks:
                    own.append(statistics.median(x["wait"] / (x["compute"] + x["wait"]) for x in mine[r]))
                    span.append(
                        statistics.median(
                            (s - x["compute"] - least) / (s - least) for x, s, least in zip(mine[r], spans, local)
                        )
                    )
                idle, step = predicted(p, m, v, block_s)
                cells = [f"{statistics.mean(x):.3f} ({', '.join(f'{y:.3f}' for y in x)})" for x in (own, span)]
                lines.append(
                    f"| {p} | {m} | {v} | {' | '.join(cells)} | {idle:.3f} "
                    f"| {1e3 * statistics.median(spans):.0f} | {1e3 * step:.0f} |"
                )
    return "\n".join(lines)


def measure(repeats: int, block_ms: float) -> tuple[str, dict[tuple[int, int], list[dict]]]:
    """Run the workers (one launch per pipeline size); (the run's conditions in a line, rows by (pp, rank))."""
    from _results import OtherWork

    load_start = os.getloadavg()[0]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp, OtherWork() as other:
        launcher = Path(sys.executable).parent / "deepspeed"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
        for p in PIPELINES:
            cmd = [str(launcher), "--num_gpus", str(p), __file__, "--worker-out", tmp]
            cmd += ["--repeats", str(repeats), "--block-ms", str(block_ms)]
            subprocess.run(cmd, env=env, check=True, capture_output=True)
        for f in Path(tmp).glob("pp*.rank*.json"):
            pp, rank = f.stem.removeprefix("pp").split(".rank")
            rows[(int(pp), int(rank))] = json.loads(f.read_text())
    t_f, t_b = (x * block_ms for x in stage_costs(1, 1.0))
    conditions = (
        f"gloo, p processes x 1 thread, {repeats} repeats after one warm-up round; {BLOCKS} blocks sleeping "
        f"{block_ms:g} ms forward, {2 * block_ms:g} ms backward (a stage of 16 / p blocks: T_F = {t_f:g} / p ms, "
        f"T_B = {t_b:g} / p ms); load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
        f"other work on the machine meanwhile: {other.cores:.1f} cores."
    )
    return conditions, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-ms", type=float, default=20.0, help="a block's forward sleep (its backward: twice it)")
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--note", default="", help="a line on the machine's load, written under the table")
    ap.add_argument("--rows", default=None, help="also write every rank's timed steps to this JSON file")
    ap.add_argument("--from-rows", default=None, help="summarise a --rows file instead of running")
    ap.add_argument("--worker-out", default=None)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    block_s = args.block_ms / 1e3
    if args.worker_out:
        worker(args.worker_out, args.repeats, block_s)
        return
    if args.from_rows:
        saved = json.loads(Path(args.from_rows).read_text())
        conditions = saved["conditions"]
        rows = {tuple(int(x) for x in key.split(".")): r for key, r in saved["rows"].items()}
    else:
        conditions, rows = measure(args.repeats, args.block_ms)
    if args.rows:
        keyed = {f"{pp}.{rank}": r for (pp, rank), r in sorted(rows.items())}
        Path(args.rows).write_text(json.dumps({"conditions": conditions, "rows": keyed}))
    body = f"{conditions}\n\n{summarise(rows, block_s)}"
    if args.note:
        body += f"\n\n{args.note}"
    print(body)
    if args.markdown:
        from _results import write_markdown

        write_markdown(
            args.markdown,
            "Interleaved 1F1B's bubble at pp 2 and 4, v 1, 2 and 4 (blocks of fixed wall-clock cost)",
            f"python benchmarks/interleaved_bubble.py --repeats {args.repeats} --block-ms {args.block_ms:g}",
            body,
        )


if __name__ == "__main__":
    main()
