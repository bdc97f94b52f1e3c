"""Expert parallelism on CPU: the time of dispatch + combine (the counts exchange, the four variable-split
all-to-alls of forward and backward, the permutations) against the local experts' compute (grouped GEMM, forward +
backward), for one ``expert_parallel.layer.ExpertParallelMoE`` at ep 2 and 4, gloo, one process per EP rank.

    OMP_NUM_THREADS=1 python benchmarks/ep_dispatch.py [--repeats 7] [--shapes tiny,small]
        [--markdown benchmarks/results/ep_dispatch.md]

Each phase is timed on its own between barriers, wall clock (a collective's time is mostly waiting), the slowest
rank's, median of ``--repeats`` after one warm-up.  The router is random-normal, so the load is near even.
"""

from __future__ import annotations

import argparse
import itertools
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
from ds_megatron.model.moe_layer import SparseMoeBlock
from ds_megatron.topology import Group

# (name, tokens per rank, h, F, E, k): moe-tiny's layer at s 256, b 2 per rank; a wider one with more experts
SHAPES = (("tiny", 512, 128, 64, 8, 2), ("small", 2048, 512, 256, 16, 4))
EPS = (2, 4)
CONDITIONS = (
    "One gloo process per EP rank, one thread each, all on this machine's cores (ep 4 puts two processes on a core "
    "of a 2-core machine); {trials} runs of each row, median of {repeats} repeats each, the slowest rank's. "
    "Dispatch + combine: the count exchange with its device-to-host copy, the forward and backward all-to-alls and "
    "the permutations, the experts replaced by the identity. Experts: the local experts' grouped GEMMs on the rows "
    "received, forward + backward. Layer: the whole layer (router, both, weighted sum). CPU time is the measure: wall "
    "time counts waiting for a core the other processes (this benchmark's and other work, last column) hold, and "
    "here exceeds CPU time several-fold."
)


def _timed(fn, repeats: int) -> tuple[float, float]:
    """The slowest rank's (wall, CPU) seconds of ``fn()``, each the median over repeats (one warm-up).  CPU time is
    the process's, its threads included (gloo's transport), and leaves out the time a rank waits for the others or
    for a core; on a shared machine it is the steadier of the two."""
    walls, cpus = [], []
    for i in range(repeats + 1):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        seconds = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        if i:
            walls.append(float(seconds[0]))
            cpus.append(float(seconds[1]))
    return statistics.median(walls), statistics.median(cpus)


def _rank(rank: int, world: int, init: str, shape: tuple, repeats: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))  # fmt: skip
    _, n, h, f, e, k = shape
    torch.manual_seed(0)
    block = SparseMoeBlock(h, f, e, k, norm_topk_prob=True)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    group = dist.new_group(list(range(world)))
    layer = ExpertParallelMoE.from_block(block, Group(group, rank, world))
    torch.manual_seed(1 + rank)
    x = torch.randn(n, h)
    weights, experts, _ = layer.gate(x)
    pairs = experts.reshape(-1)
    order = torch.argsort(pairs, stable=True)
    per_expert = torch.bincount(pairs, minlength=e)
    rows = x[order // k]
    plan = plan_dispatch(per_expert, group)
    received = dispatch(rows, plan, group).detach()

    def comm() -> None:  # counts exchange, dispatch and combine, forward and backward (experts as the identity)
        leaf = rows.detach().requires_grad_()
        p = plan_dispatch(per_expert, group)
        back = combine(dispatch(leaf, p, group), p, group)
        back.backward(torch.ones_like(back))

    def run_experts() -> None:
        leaf = received.detach().requires_grad_()
        y = layer.experts.grouped_mlp(leaf, plan.local_counts)
        y.backward(torch.ones_like(y))

    def whole() -> None:
        leaf = x.detach().requires_grad_()
        y, _ = layer(leaf)
        y.backward(torch.ones_like(y))

    result = {name: _timed(fn, repeats) for name, fn in (("comm", comm), ("experts", run_experts), ("layer", whole))}
    counts = torch.tensor([received.shape[0]], dtype=torch.float64)
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    if rank == 0:
        out.update(result, rows_min=int(min(gathered)), rows_max=int(max(gathered)))
    dist.destroy_process_group()


def measure(shape: tuple, ep: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(ep, os.path.join(tmp, "init"), shape, repeats, out), nprocs=ep)
        return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--trials", type=int, default=2, help="runs of each row (the spread is the noise)")
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="comma-separated shape names")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    header = (
        "| shape | tokens/rank, h, F, E, k | ep | rows received (min-max) | dispatch+combine CPU ms | experts CPU ms "
        "| dispatch+combine / experts (CPU) | dispatch+combine wall ms | experts wall ms | layer wall ms "
        "| other work (cores) |"
    )
    rows = [header, "|---" * 11 + "|"]
    for shape in (s for s in SHAPES if s[0] in args.shapes.split(",")):
        name, n, h, f, e, k = shape
        for ep, _ in itertools.product(EPS, range(args.trials)):
            with OtherWork() as other:
                r = measure(shape, ep, args.repeats)
            (comm_wall, comm_cpu), (exp_wall, exp_cpu) = r["comm"], r["experts"]
            rows.append(
                f"| {name} | {n}, {h}, {f}, {e}, {k} | {ep} | {r['rows_min']}-{r['rows_max']} | {1e3 * comm_cpu:.1f} "
                f"| {1e3 * exp_cpu:.1f} | {comm_cpu / exp_cpu:.2f} | {1e3 * comm_wall:.1f} | {1e3 * exp_wall:.1f} "
                f"| {1e3 * r['layer'][0]:.1f} | {other.cores:.1f} |"
            )
            print(rows[-1], flush=True)
    if args.markdown:
        cmd = "OMP_NUM_THREADS=1 python benchmarks/ep_dispatch.py"
        body = "\n".join(rows) + "\n\n" + CONDITIONS.format(trials=args.trials, repeats=args.repeats)
        write_markdown(args.markdown, "Expert parallelism: dispatch + combine vs expert compute (CPU, gloo)", cmd, body)


if __name__ == "__main__":
    main()
