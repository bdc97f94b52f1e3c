"""Where SP's extra step time goes on CPU: the cost of one gloo collective of each kind ds_megatron uses, at the
shape of the efficiency benchmark (s 256, b 4, h 256, fp32, tp 2), and the SP-on minus SP-off difference the counts
predict.

    python benchmarks/gloo_collectives.py [--reps 200] [--markdown OUT.md]

Per transformer block and micro-batch, SP runs 6 all-gathers and 4 reduce-scatters where SP off runs 4 all-reduces
(tests/launcher/test_sequence_parallel.py counts them).  gloo has no reduce-scatter: ds_megatron emulates it by an
all-reduce of the full tensor, so on CPU each of SP's reduce-scatters costs an all-reduce, and SP pays its 6
all-gathers on top (on NCCL an all-reduce costs about a reduce-scatter plus an all-gather, and SP's extra traffic is
2 all-gathers, the re-gathers of the saved shards).  The embedding adds 1 all-gather and the output layer 2, per
micro-batch.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _results import write_markdown  # noqa: E402

from ds_megatron.tensor_parallel.mappings import _reduce_scatter_dim0  # noqa: E402

S, B, H, TP = 256, 4, 256, 2
BLOCKS, MICRO_BATCHES = 4, 4


def _time(fn, reps: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(rank: int, port: int, reps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    full = torch.randn(S, B, H)
    shard = torch.randn(S // TP, B, H)

    summed = torch.zeros(S, B, H)  # zeros stay zeros however often they are summed

    def all_reduce():  # as ds_megatron runs SP off's g and f: in place on a buffer it owns
        dist.all_reduce(summed)

    def all_gather():
        parts = [torch.empty_like(shard) for _ in range(TP)]
        dist.all_gather(parts, shard)
        torch.cat(parts)

    group = dist.new_group(list(range(TP)))

    def reduce_scatter():  # as ds_megatron runs it on gloo: all-reduce of a copy, keep this rank's chunk
        _reduce_scatter_dim0(full, group)

    result = {
        "all_reduce": _time(all_reduce, reps),
        "all_gather": _time(all_gather, reps),
        "reduce_scatter": _time(reduce_scatter, reps),
    }
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--markdown")
    args = ap.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(port, args.reps, queue), nprocs=TP, join=True, start_method="spawn")
    r = queue.get()
    extra_gathers = MICRO_BATCHES * (6 * BLOCKS + 1 + 2)
    # SP's reduce-scatters take the place of SP off's all-reduces one for one (4 per block, the embedding's and the
    # output layer's, per micro-batch); on gloo each costs its all-reduce plus the copy and the chunk.
    scatters = MICRO_BATCHES * (4 * BLOCKS + 1 + 1)
    predicted = extra_gathers * r["all_gather"] + scatters * (r["reduce_scatter"] - r["all_reduce"])
    table = "\n".join(
        [
            f"gloo, 2 processes, fp32 [s, b, h] = [{S}, {B}, {H}] ({S * B * H * 4 / 2**20:.0f} MiB), median of "
            f"{args.reps}:",
            "",
            "| collective | ms |",
            "|---|---|",
            f"| all-reduce of [s, b, h], in place (SP off's g and f) | {1000 * r['all_reduce']:.2f} |",
            f"| all-gather of [s/2, b, h] into [s, b, h] | {1000 * r['all_gather']:.2f} |",
            f"| reduce-scatter of [s, b, h] as emulated on gloo (copy, all-reduce, chunk) | "
            f"{1000 * r['reduce_scatter']:.2f} |",
            "",
            f"SP's extra communication per step at {BLOCKS} blocks x {MICRO_BATCHES} micro-batches: {extra_gathers} "
            f"all-gathers, and {scatters} reduce-scatters in place of as many all-reduces = "
            f"**{1000 * predicted:.0f} ms** predicted SP-on minus SP-off step time.",
        ]
    )
    print(table)
    if args.markdown:
        write_markdown(args.markdown, "gloo collective costs", "python benchmarks/gloo_collectives.py", table)


if __name__ == "__main__":
    main()
