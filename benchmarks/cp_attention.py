"""Ring attention at cp 2 on two CPU processes (gloo) against one whole-sequence call of the same kernel: time of
forward + backward and peak memory per process, at long sequences and a small head size.

    python benchmarks/cp_attention.py [--lengths 4096 8192 16384] [--reps 3] [--markdown OUT.md]

Each configuration runs in fresh processes, so the peak resident set (ru_maxrss) minus the resident set just before
the first call is what the attention itself needs (inputs excluded, activations and their gradients included).
gloo point-to-point between processes on one CPU machine is a memory copy through the kernel's sockets, not NVLink:
the time here says whether the ring's bookkeeping costs anything against the compute, not what a GPU ring costs.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _results import write_markdown  # noqa: E402

from ds_megatron.context_parallel.attention import ring_attention  # noqa: E402

B, N, D = 1, 4, 32  # h = 128
EAGER_MAX = 8192  # eager materialises [b, n, s, s] scores: 1 GiB of fp32 at 8192, 4 GiB at 16384


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(rank: int, world: int, port: int, s: int, kernel: str, reps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    group = None
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        group = dist.new_group(list(range(world)))
    torch.manual_seed(rank)
    local = s // world
    q, k, v = (torch.randn(B, N, local, D, requires_grad=True) for _ in range(3))
    gout = torch.randn(B, N, local, D)
    base = _current_rss_mib()
    times, cpu, saved = [], [], {}

    def pack(t: torch.Tensor) -> torch.Tensor:  # what autograd keeps from forward to backward, once per storage
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for rep in range(reps):
        if group is not None:
            dist.barrier(group)
        t0, c0 = time.perf_counter(), time.process_time()
        # saved bytes counted in the first call only: later calls save new outputs at other addresses
        hooks = (pack, lambda t: t) if rep == 0 else (lambda t: t, lambda t: t)
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            out = ring_attention(q, k, v, group, kernel, 1 / math.sqrt(D))
        out.backward(gout)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        q.grad = k.grad = v.grad = None
    queue.put((rank, statistics.median(times), statistics.median(cpu), _rss_mib() - base, sum(saved.values()) / 2**20))
    if group is not None:
        dist.destroy_process_group()


def measure(s: int, kernel: str, world: int, reps: int) -> tuple[float, ...]:
    """The largest over the ranks of: median wall and CPU seconds of forward + backward, peak MiB, saved MiB."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(world, port, s, kernel, reps, queue), nprocs=world, start_method="spawn")
    results = [queue.get() for _ in range(world)]
    return tuple(max(r[i] for r in results) for i in range(1, 5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--markdown")
    args = ap.parse_args()
    rows = [
        "| kernel | s | whole: wall s | ring: wall s | whole: CPU s | ring: CPU s per process | CPU ratio "
        "| whole: peak MiB | ring: peak MiB | peak ratio | whole: saved MiB | ring: saved MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kernel in ("sdpa", "eager"):
        for s in args.lengths:
            if kernel == "eager" and s > EAGER_MAX:
                continue
            t1, c1, m1, saved1 = measure(s, kernel, 1, args.reps)
            t2, c2, m2, saved2 = measure(s, kernel, 2, args.reps)
            rows.append(
                f"| {kernel} | {s} | {t1:.2f} | {t2:.2f} | {c1:.2f} | {c2:.2f} | {c2 / c1:.2f} | {m1:.0f} | {m2:.0f} "
                f"| {m2 / m1:.2f} | {saved1:.1f} | {saved2:.1f} |"
            )
            print(rows[-1], flush=True)
    body = "\n".join(
        [
            f"Causal attention forward + backward, fp32, b {B}, {N} heads of {D} (h {N * D}), one thread per process, "
            f"median of {args.reps} (the ring's numbers are its largest rank's).  CPU s: the process's own CPU time "
            "(time.process_time), which other jobs on the machine do not inflate, unlike the wall time.  Whole: one "
            "process, one call over the "
            "whole sequence; ring: cp 2 on two processes, per process.  Peak MiB: the largest resident-set growth of "
            "a process over its inputs (ru_maxrss), transient buffers and the allocator's caches included.  Saved "
            "MiB: what autograd keeps from forward to backward (q, k, v, output, log-sum-exp), the part a model "
            "stores per layer.",
            "",
            *rows,
            "",
            "gloo point-to-point on one CPU machine is a socket copy between processes, not NVLink or InfiniBand; the "
            "processes share the machine's cores (and, on a shared runner, other jobs), so times are indicative only.",
        ]
    )
    print(body)
    if args.markdown:
        write_markdown(
            args.markdown,
            "Ring attention (cp 2) against one whole-sequence call",
            "python benchmarks/cp_attention.py",
            body,
        )


if __name__ == "__main__":
    main()
