"""Which ds_megatron files one training step runs through, and how often one block's forward moves between files.

    PYTHONPATH=. .venv/bin/python scripts/trace_step.py [--attention eager|sdpa] [--modules core_attn,...]

Four gloo ranks (torch.multiprocessing, CPU) build the real engine (``engine.build_engine``: the DeepSpeed pipeline
engine over the pipeline module) for the ``llama-tiny`` size at tp 2 with sequence parallelism, cp 2 (ring), pp 1,
selective recompute; then run two optimizer steps through ``engine.train_batch``.  The first step warms up (one-time
work: lazy imports, caches); the second is traced on rank 0 under ``sys.setprofile`` (and ``threading.setprofile``),
counting the distinct ``ds_megatron/`` files whose Python functions are entered.  One block's forward (the first
``BlockPipe.forward`` of the traced step, so not a recompute) is also recorded as the sequence of ds_megatron files
the innermost ds_megatron frame sits in: a move is a change of that file.  Printed by rank 0; nothing is written.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import sys
import threading
from collections import Counter
from pathlib import Path

import torch
import torch.multiprocessing as mp

PACKAGE = str(Path(__file__).resolve().parents[1] / "ds_megatron") + os.sep
WORLD = 4
SEQ = 32


def run_config(attention: str, modules: list[str]) -> dict:
    return {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "ds_megatron": {
            "model": {
                "size": "llama-tiny",
                "vocab_size": 256,
                "seq_length": SEQ,
                "attention": attention,
                "dropout": 0.0,
            },
            "parallel": {"tp": 2, "cp": 2, "cp_comm": "ring", "sequence_parallel": True},
            "recompute": {"policy": "selective", "modules": modules},
            "train": {"seed": 1234},
        },
    }


def package_file(frame) -> str | None:
    """The ds_megatron file (relative to the package) of the innermost ds_megatron frame at or above ``frame``."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PACKAGE):
            return name[len(PACKAGE) :]
        frame = frame.f_back
    return None


def is_block_forward(frame) -> bool:
    return frame.f_code.co_name == "forward" and type(frame.f_locals.get("self")).__name__ == "BlockPipe"


class StepTrace:
    """A profile function: the ds_megatron files entered, and one block's forward as a sequence of files."""

    def __init__(self):
        self.files: Counter[str] = Counter()
        self.block_path: list[str] | None = None  # recording while a list, done once the block returns
        self.block_done = False

    def __call__(self, frame, event, arg):
        if event not in ("call", "return"):
            return
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(PACKAGE):
            self.files[name[len(PACKAGE) :]] += 1
        if self.block_done:
            return
        if self.block_path is None:
            if event == "call" and is_block_forward(frame):
                self.block_path = [name[len(PACKAGE) :]]
            return
        where = package_file(frame if event == "call" else frame.f_back)
        if where is not None and where != self.block_path[-1]:
            self.block_path.append(where)
        if event == "return" and is_block_forward(frame):
            self.block_done = True


def worker(rank: int, port: int, attention: str, modules: list[str], out) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD)
    )
    torch.set_num_threads(1)
    from ds_megatron.config import resolve
    from ds_megatron.data.stream import MicroBatchStream
    from ds_megatron.engine import build_engine

    run = resolve(run_config(attention, modules), WORLD)
    built = build_engine(run)
    topo = built.topology
    generator = torch.Generator().manual_seed(0)
    windows = [torch.randint(0, run.model.vocab_size, (SEQ + 1,), generator=generator) for _ in range(64)]
    stream = MicroBatchStream(
        windows, run.micro_batch_size, run.grad_accum_steps, topo.dp_rank, run.dp, 0, topo.cp_rank, topo.cp
    )
    first = float(built.engine.train_batch(stream))  # warm-up: one-time work stays out of the count
    trace = StepTrace()
    if rank == 0:
        threading.setprofile(trace)
        sys.setprofile(trace)
    second = float(built.engine.train_batch(stream))
    sys.setprofile(None)
    threading.setprofile(None)
    if rank == 0:
        out.put((first, second, dict(trace.files), trace.block_path))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attention", default="eager", choices=("eager", "sdpa"))
    parser.add_argument("--modules", default="core_attn", help="selective recompute's modules, comma-separated")
    args = parser.parse_args()
    modules = args.modules.split(",")
    from ds_megatron.config import resolve

    resolve(run_config(args.attention, modules), WORLD)  # a refused setting stops here, before any rank starts
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, args.attention, modules, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    while True:  # a rank that fails (its traceback printed) ends the wait
        try:
            first, second, files, block = out.get(timeout=5)
            break
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                sys.exit("a rank failed")
    for p in procs:
        p.join()
    print(f"llama-tiny, tp 2 + SP, cp 2 (ring), pp 1, {args.attention}, selective {modules}; 4 gloo ranks, rank 0")
    print(f"losses: warm-up step {first:.4f}, traced step {second:.4f}")
    print(f"files one training step visits: {len(files)}")
    for name, calls in sorted(files.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {calls:6d}  {name}")
    moves = len(block) - 1
    print(f"one block's forward: {moves} moves between {len(set(block))} files")
    print("  " + " -> ".join(block))


if __name__ == "__main__":
    main()
