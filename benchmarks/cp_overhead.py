"""Where a step of ``cp_vs_ulysses.py``'s systems spends its CPU time, op by op, and the same step before and after a
change, interleaved in one run.

    python benchmarks/cp_overhead.py [--world 1|2] [--reps 6] [--before REF] [--comms a2a,ring] [--rows 30]
                                     [--markdown OUT.md]

Systems: transformers' Llama (world 1) or DeepSpeed Ulysses sp = world, and ds_megatron at cp = world (1: its
single process) with each ``--comms``, built and stepped exactly as ``cp_vs_ulysses.py`` does (forward, backward,
the gradient all-reduce).  ``--before REF`` adds, for each ds_megatron system, the same system running the code of
git revision REF for CP attention (``context_parallel/attention.py`` with its ``kernels.py``); everything else is the
working tree's.  Systems run in turn within each repetition
(one warm-up first), so load from other processes falls on all of them alike.

Reported: per system the median and minimum CPU seconds per step over all ranks (``time.process_time``), and per
op (rank 0) the smallest CPU time any repetition took.  An op's time is the calling thread's CPU time around each
aten call (``time.thread_time``, taken by a ``TorchDispatchMode``), not torch.profiler's wall-clock self time: on a
machine shared with other work a thread that is descheduled inside an op is not charged for it, and the minimum over
repetitions is the least disturbed estimate of what the op costs.  Each repetition runs every system twice: once
plain (its CPU seconds) and once with the op timer (its per-op times; the timer's own Python overhead falls outside
the ops).  What no aten op is charged with (Python, the autograd engine, gloo's own threads) shows only in the CPU
seconds per step.  The op table's first line sums the minima.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from _results import write_markdown  # noqa: E402


def _module_at(ref: str, path: str, name: str, replace: dict[str, str] | None = None) -> types.ModuleType:
    """The file ``path`` as it is at git revision ``ref``, loaded as module ``name`` (imports rewritten by
    ``replace``)."""
    source = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True)
    text = source.stdout
    for old, new in (replace or {}).items():
        text = text.replace(old, new)
    module = types.ModuleType(name)
    module.__file__ = f"{ref}:{path}"
    sys.modules[name] = module
    exec(compile(text, module.__file__, "exec"), module.__dict__)
    return module


def before_patches(ref: str) -> list[tuple[object, str, object]]:
    """(module, attribute, value at ``ref``) for every function this benchmark compares before and after."""
    import ds_megatron.parallelize as parallelize

    _module_at(ref, "ds_megatron/context_parallel/kernels.py", "_before_cp_kernels")
    old_comm = _module_at(
        ref,
        "ds_megatron/context_parallel/attention.py",
        "_before_cp_comm",
        {"from ds_megatron.context_parallel.kernels import": "from _before_cp_kernels import"},
    )
    return [(parallelize, "cp_attention", old_comm.cp_attention)]


class Before:
    """A ds_megatron system whose forward (and so the autograd nodes its backward runs) uses ``patches``."""

    def __init__(self, system, patches, ref: str):
        self.system, self.patches, self.name = system, patches, f"{system.name} (before: {ref})"
        self.reduce = system.reduce

    def batch(self, window):
        return self.system.batch(window)

    def loss(self, batch):
        with contextlib.ExitStack() as stack:
            for module, attr, value in self.patches:
                saved = getattr(module, attr)
                setattr(module, attr, value)
                stack.callback(setattr, module, attr, saved)
            return self.system.loss(batch)

    def parameters(self):
        return self.system.parameters()


class OpTimer(TorchDispatchMode):
    """Per aten op: the calling thread's CPU milliseconds (``time.thread_time``) and calls, summed over a step."""

    def __init__(self) -> None:
        super().__init__()
        self.ms: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.thread_time()
        out = func(*args, **(kwargs or {}))
        key = str(func).removesuffix(".default")
        self.ms[key] += (time.thread_time() - t0) * 1e3
        self.calls[key] += 1
        return out


def worker(rank: int, world: int, port: int, args: dict, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    import cp_vs_ulysses as bench
    import deepspeed
    from cp_memory import SHAPE, window_for

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    seq = args["seq"]
    patches = before_patches(args["before"]) if args["before"] else None
    systems: list = [bench.Ulysses(world, seq)]
    for comm in args["comms"] if world > 1 else ["ring"]:
        systems.append(bench.Megatron(1, world, seq, comm))
        if patches:
            systems.append(Before(bench.Megatron(1, world, seq, comm), patches, args["before"]))
    window = window_for(systems[-1].system.run if patches else systems[-1].run, SHAPE["vocab"])
    batches = [s.batch(window) for s in systems]
    ops: list[dict] = [collections.defaultdict(lambda: [float("inf"), 0]) for _ in systems]
    cpu: list[list[float]] = [[] for _ in systems]
    for rep in range(args["reps"] + 1):  # the first repetition warms up and is not counted
        for i, (s, b) in enumerate(zip(systems, batches, strict=True)):
            dist.barrier()
            c0 = time.process_time()
            bench.step(s, b, world)
            dc = torch.tensor([time.process_time() - c0])
            dist.all_reduce(dc)
            dist.barrier()
            with OpTimer() as timer:
                bench.step(s, b, world)
            if rep:
                cpu[i].append(dc.item())
                for key, ms in timer.ms.items():
                    entry = ops[i][key]
                    entry[0], entry[1] = min(entry[0], ms), timer.calls[key]
    if rank == 0:
        queue.put(([s.name for s in systems], [dict(o) for o in ops], cpu))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--before", help="git revision to compare with (e.g. main)")
    ap.add_argument("--comms", default="a2a,ring")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--markdown", help="append the tables to this file (created with a header if missing)")
    args = ap.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    load, t0 = os.getloadavg(), time.time()
    run = {"seq": args.seq, "reps": args.reps, "before": args.before, "comms": args.comms.split(",")}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.world, port, run, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    names, ops, cpu = queue.get()
    for p in procs:
        p.join()
    after = os.getloadavg()
    base = statistics.median(cpu[0])
    lines = [
        f"{args.world} process(es), s {args.seq}, {args.reps} repetitions after one warm-up, systems interleaved. "
        f"Load average (1, 5, 15 min) before {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}; after {after[0]:.1f}, "
        f"{after[1]:.1f}, {after[2]:.1f}; {time.time() - t0:.0f} s.",
        "",
        "| system | CPU s per step, all ranks: median | min | x first (median) |",
        "|---|---|---|---|",
    ]
    for name, c in zip(names, cpu, strict=True):
        lines.append(f"| {name} | {statistics.median(c):.3f} | {min(c):.3f} | {base / statistics.median(c):.2f} |")
    lines += ["", "Per aten op, rank 0: the smallest thread CPU ms of any repetition (calls per step).", ""]
    lines += ["| op | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines.append("| sum of the minima | " + " | ".join(f"{sum(v[0] for v in o.values()):.0f}" for o in ops) + " |")
    keys = sorted(set().union(*ops), key=lambda k: -max(o.get(k, [0])[0] for o in ops))
    for k in keys[: args.rows]:
        cells = [f"{o[k][0]:.1f} ({o[k][1]})" if k in o else "-" for o in ops]
        lines.append(f"| {k[:60]} | " + " | ".join(cells) + " |")
    body = "\n".join(lines) + "\n"
    print(body)
    if args.markdown:
        from cp_vs_ulysses import code_revision

        command = "python benchmarks/cp_overhead.py " + " ".join(sys.argv[1:])
        if not os.path.exists(args.markdown):
            write_markdown(args.markdown, "Where a CP step's CPU time goes, op by op", command, "")
        with open(args.markdown, "a") as f:
            f.write(f"\n## {args.world} process(es): `{command}`, code at {code_revision()}\n\n{body}")


if __name__ == "__main__":
    main()
