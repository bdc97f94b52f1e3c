"""Expert parallelism on CPU: one ``expert_parallel.layer.ExpertParallelMoE`` forward + backward at ep 2 with the
blocking exchange (``ep_dispatch_chunks`` 1) against the overlapped one (C = 2, 4: ``expert_parallel.overlap``),
gloo, one process per EP rank.

    OMP_NUM_THREADS=1 python benchmarks/ep_overlap.py [--repeats 9] [--trials 2] [--shapes tiny,wide,wide-shared]
        [--markdown benchmarks/results/ep_overlap.md]

Each round times every C once, in a rotating order (so that a burst of other work on the machine falls on each
alike), between barriers: wall clock and the process's CPU time (gloo's threads included), the slowest rank's,
median over ``--repeats`` rounds after one warm-up.  The exchange alone (the count exchange, dispatch and combine
forward and backward, the experts replaced by the identity, blocking) is timed the same way, for its share of the
blocking layer.  Every C's output and gradients are checked equal to C 1's, bit for bit, before timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks._results import OtherWork, write_markdown
from ds_megatron.expert_parallel.dispatch import combine, dispatch, plan_dispatch
from ds_megatron.expert_parallel.layer import ExpertParallelMoE
from ds_megatron.model.llama.model import LlamaConfig, LlamaMLP
from ds_megatron.model.moe_layer import SparseMoeBlock, pairs_by_expert
from ds_megatron.topology import Group

EP = 2
CHUNKS = (1, 2, 4)
# (name, tokens per rank, h, F, E, k, shared expert width): moe-tiny's layer (s 256, b 2 per rank); a wide hidden size
# with narrow experts, where the exchange (bytes ~ h) weighs more against the experts (flops ~ h F); the same with a
# Qwen2-MoE shared expert of width 4 F, which the overlapped path runs while the dispatch is in flight
SHAPES = (
    ("tiny", 512, 128, 64, 8, 2, 0),
    ("wide", 1024, 1024, 64, 8, 2, 0),
    ("wide-shared", 1024, 1024, 64, 8, 2, 256),
)
CONDITIONS = (
    "Two gloo processes (ep 2) on this machine's cores, one compute thread each (gloo's transport runs on its own "
    "threads, which on a 2-core machine share the two cores with the compute); fp32; a random-normal router (load "
    "near even). {trials} runs of each row, median of {repeats} rounds each, the slowest rank's. Exchange share: the "
    "blocking exchange alone (count exchange, dispatch and combine, forward and backward, identity experts) over the "
    "blocking layer, wall. C / 1: the layer's wall time at C chunks over the blocking layer's in the same run."
)


def _block(shape: tuple) -> SparseMoeBlock:
    _, _, h, f, e, k, shared = shape
    expert = None
    if shared:
        expert = LlamaMLP(LlamaConfig(hidden_size=h, intermediate_size=shared, num_heads=1, vocab_size=8))
    block = SparseMoeBlock(h, f, e, k, norm_topk_prob=True, shared_expert=expert)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block


def _slowest(wall: float, cpu: float) -> tuple[float, float]:
    seconds = torch.tensor([wall, cpu], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds[0]), float(seconds[1])


def _timed(fn) -> tuple[float, float]:
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return _slowest(time.perf_counter() - t0, time.process_time() - c0)


def _rank(rank: int, world: int, init: str, shape: tuple, repeats: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))  # fmt: skip
    torch.manual_seed(0)
    block = _block(shape)
    group = Group(dist.new_group(list(range(world))), rank, world)
    layers = {c: ExpertParallelMoE.from_block(block, group, None, c) for c in CHUNKS}
    torch.manual_seed(1 + rank)
    x = torch.randn(shape[1], shape[2])

    def step(layer):
        for p in layer.parameters():
            p.grad = None
        leaf = x.detach().requires_grad_()
        y, _ = layer(leaf)
        y.backward(torch.ones_like(y))
        return [y, leaf.grad, *(p.grad for p in layer.parameters())]

    reference = step(layers[1])
    equal = all(all(torch.equal(a, b) for a, b in zip(step(layers[c]), reference, strict=True)) for c in CHUNKS)

    _, experts, _ = layers[1].gate(x)
    order, per_expert = pairs_by_expert(experts, shape[4])
    rows = x[order // shape[5]]

    def exchange() -> None:  # the blocking exchange alone, the experts as the identity
        leaf = rows.detach().requires_grad_()
        plan = plan_dispatch(per_expert, group.group)
        back = combine(dispatch(leaf, plan, group.group), plan, group.group)
        back.backward(torch.ones_like(back))

    times: dict = {c: [] for c in (*CHUNKS, "exchange")}
    for i in range(repeats + 1):
        names = [*CHUNKS, "exchange"]
        names = names[i % len(names) :] + names[: i % len(names)]
        for name in names:
            t = _timed(exchange if name == "exchange" else (lambda c=name: step(layers[c])))
            if i:
                times[name].append(t)
    received = plan_dispatch(per_expert, group.group).recv_splits
    if rank == 0:
        out.update(
            {
                str(name): (statistics.median(w for w, _ in ts), statistics.median(c for _, c in ts))
                for name, ts in times.items()
            },
            equal=equal,
            rows=sum(received),
        )
    dist.destroy_process_group()


def measure(shape: tuple, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(EP, os.path.join(tmp, "init"), shape, repeats, out), nprocs=EP)
        return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--trials", type=int, default=2, help="runs of each row (the spread is the noise)")
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="comma-separated shape names")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    header = (
        "| shape | tokens/rank, h, F, E, k, shared F | rows received (rank 0) | exchange share (blocking) "
        + "".join(f"| C {c} wall ms " for c in CHUNKS)
        + "".join(f"| C {c} / 1 " for c in CHUNKS[1:])
        + "".join(f"| C {c} CPU ms " for c in CHUNKS)
        + "| bit-equal | other work (cores) |"
    )
    rows = [header, "|---" * (5 + 3 * len(CHUNKS)) + "|"]
    for shape in (s for s in SHAPES if s[0] in args.shapes.split(",")):
        name, n, h, f, e, k, shared = shape
        for _ in range(args.trials):
            with OtherWork() as other:
                r = measure(shape, args.repeats)
            wall = {c: r[str(c)][0] for c in CHUNKS}
            rows.append(
                f"| {name} | {n}, {h}, {f}, {e}, {k}, {shared or '-'} | {r['rows']} "
                f"| {r['exchange'][0] / wall[1]:.2f} "
                + "".join(f"| {1e3 * wall[c]:.1f} " for c in CHUNKS)
                + "".join(f"| {wall[c] / wall[1]:.3f} " for c in CHUNKS[1:])
                + "".join(f"| {1e3 * r[str(c)][1]:.1f} " for c in CHUNKS)
                + f"| {'yes' if r['equal'] else 'NO'} | {other.cores:.1f} |"
            )
            print(rows[-1], flush=True)
    if args.markdown:
        cmd = "OMP_NUM_THREADS=1 python benchmarks/ep_overlap.py"
        body = "\n".join(rows) + "\n\n" + CONDITIONS.format(trials=args.trials, repeats=args.repeats)
        write_markdown(
            args.markdown, "Expert parallelism: the exchange overlapped with the experts (CPU, gloo)", cmd, body
        )


if __name__ == "__main__":
    main()
