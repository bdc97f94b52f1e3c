"""The ring's chunked attention on one device against one whole-sequence kernel call: time, peak memory, error.

    python benchmarks/gpu_cp_kernel.py [--seqs 16384 65536] [--cps 2 4 8] [--markdown OUT.md]
    python benchmarks/gpu_cp_kernel.py --device cpu --seqs 256 --cps 2 --heads 2 --head-dim 16   (a smoke run)

Every CP rank of a ring is played in turn on the one device: rank i takes its chunks (``cp.slice_for_rank``), and
for each ring step the block of the K/V it holds then (``cp_comm._ring_block``: the ring's own choice of rows,
key rows and causal flag) is computed with ``cp_kernels.block_forward`` and merged into an fp32 accumulator with
the ring's log-sum-exp merge (``cp_comm._merge``); backward runs ``cp_kernels.block_backward`` per block with the
final output and lse, dK/dV summed in fp32, as the ring's travelling accumulator does.  No messages are sent: this
measures the kernels and the merge, not the exchange.  The whole-sequence call is ``block_forward`` /
``block_backward`` of one causal block (the same fused kernel: CUDA flash in bf16, or the CPU flash kernel).

Reported per (s, cp): the whole call's forward + backward time and the slowest simulated rank's (its blocks and
merges), their ratio against the ideal 1/cp, peak memory above the inputs (CUDA: max_memory_allocated; CPU: not
measured), and the largest difference of out, dq, dk, dv between the two in bf16 (max |x - y| over max |fp32
reference|), next to each one's difference from an fp32 reference (torch's scaled_dot_product_attention in fp32,
with autograd).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import write_markdown  # noqa: E402

from ds_megatron.context_parallel.attention import _merge, _ring_block  # noqa: E402
from ds_megatron.context_parallel.kernels import block_backward, block_forward  # noqa: E402
from ds_megatron.context_parallel.layout import slice_for_rank, token_indices, unslice  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def whole(q, k, v, dout, scale):
    out, lse = block_forward("sdpa", q, k, v, True, scale)
    return (out, *block_backward("sdpa", dout, q, k, v, out, lse, True, scale))


def ring_rank(rank, cp, q, k, v, dout, scale):
    """Rank ``rank``'s blocks of the ring over every rank's K/V: its (out, dq) and every rank's (dk, dv) share."""
    qi, gi = slice_for_rank(q, 2, rank, cp), slice_for_rank(dout, 2, rank, cp)
    c = qi.shape[2] // 2
    kvs = [(slice_for_rank(k, 2, j, cp), slice_for_rank(v, 2, j, cp)) for j in range(cp)]
    out = torch.zeros(qi.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(qi.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    srcs = [(rank - step) % cp for step in range(cp)]  # the K/V held at each ring step
    for step, src in enumerate(srcs):
        rows, cols, causal = _ring_block(rank, src, c)
        block = block_forward("sdpa", qi[:, :, rows], kvs[src][0][:, :, cols], kvs[src][1][:, :, cols], causal, scale)
        if step == 0:
            out[:, :, rows].copy_(block.out)
            lse[:, :, rows].copy_(block.lse)
        else:
            _merge(out[:, :, rows], lse[:, :, rows], block)
    out = out.to(q.dtype)
    dq = torch.zeros(qi.shape, dtype=torch.float32, device=q.device)
    dkv = {}
    for src in srcs:
        rows, cols, causal = _ring_block(rank, src, c)
        kj, vj = kvs[src]
        dq_b, dk_b, dv_b = block_backward(
            "sdpa", gi[:, :, rows], qi[:, :, rows], kj[:, :, cols], vj[:, :, cols], out[:, :, rows],
            lse[:, :, rows], causal, scale,
        )  # fmt: skip
        dq[:, :, rows] += dq_b
        acc = torch.zeros((2, *kj.shape), dtype=torch.float32, device=q.device)
        acc[0][:, :, cols] += dk_b
        acc[1][:, :, cols] += dv_b
        dkv[src] = acc
    return out, dq.to(q.dtype), dkv


def timed(fn, device, reps):
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return result, times


def peak_above(fn, device):
    """Peak bytes allocated above what was allocated before ``fn`` (CUDA only; None on CPU)."""
    if device.type != "cuda":
        fn()
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    result = fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del result
    return peak


def measure(s, cp, args, device, refs_cache):
    torch.manual_seed(0)
    shape = (args.batch, args.heads, s, args.head_dim)
    kv_shape = (args.batch, args.kv_heads, s, args.head_dim)
    q = torch.randn(shape, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(kv_shape, device=device, dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn(shape, device=device, dtype=torch.bfloat16)
    scale = 1 / math.sqrt(args.head_dim)

    if s not in refs_cache:  # fp32 reference through autograd (no s x s matrix kept on CUDA or CPU), once per s
        q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
        gqa = args.kv_heads < args.heads
        ref = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True, scale=scale, enable_gqa=gqa)
        ref.backward(dout.float())
        refs_cache.clear()
        refs_cache[s] = (ref.detach(), q32.grad, k32.grad, v32.grad)
        del q32, k32, v32, ref
    refs = refs_cache[s]

    (w_out, w_dq, w_dk, w_dv), w_times = timed(lambda: whole(q, k, v, dout, scale), device, args.reps)
    w_peak = peak_above(lambda: whole(q, k, v, dout, scale), device)

    rank_times = []
    outs, dqs = [], []
    dk = torch.zeros(kv_shape, dtype=torch.float32, device=device)
    dv = torch.zeros_like(dk)
    r_peak = None
    for rank in range(cp):
        (out, dq, dkv), t = timed(lambda rank=rank: ring_rank(rank, cp, q, k, v, dout, scale), device, args.reps)
        rank_times.append(statistics.median(t))
        outs.append(out)
        dqs.append(dq)
        for src, acc in dkv.items():  # each share goes home to the rank that owns those keys
            owned = token_indices(s, src, cp).to(device)
            dk.index_add_(2, owned, acc[0])
            dv.index_add_(2, owned, acc[1])
        if rank == 0:
            r_peak = peak_above(lambda: ring_rank(0, cp, q, k, v, dout, scale), device)
    got = (unslice(outs, 2), unslice(dqs, 2), dk.to(q.dtype), dv.to(q.dtype))
    wholes = (w_out, w_dq, w_dk, w_dv)

    def err(xs, ys):  # the largest over out, dq, dk, dv of max |x - y| relative to max |fp32 reference|
        return max(((x.float() - y.float()).abs().max() / r.abs().max()).item() for x, y, r in zip(xs, ys, refs))

    err_chunked, err_whole_ref, err_chunked_ref = err(got, wholes), err(wholes, refs), err(got, refs)
    w_med = statistics.median(w_times)
    return {
        "whole_s": w_med,
        "whole_spread": (min(w_times), max(w_times)),
        "rank_s": max(rank_times),
        "ratio": max(rank_times) / w_med,
        "whole_peak": w_peak,
        "rank_peak": r_peak,
        "err_chunked_whole": err_chunked,
        "err_whole_ref": err_whole_ref,
        "err_chunked_ref": err_chunked_ref,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seqs", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--markdown")
    args = ap.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    mib = lambda b: "-" if b is None else f"{b / 2**20:,.0f}"  # noqa: E731
    lines = [
        "| s | cp | whole fwd+bwd ms (min-max) | slowest rank ms | rank / whole (ideal 1/cp) | whole peak MiB | "
        "rank peak MiB | max rel. diff chunked vs whole | whole vs fp32 | chunked vs fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    refs_cache: dict = {}
    for s in args.seqs:
        for cp in args.cps:
            r = measure(s, cp, args, device, refs_cache)
            lo, hi = r["whole_spread"]
            lines.append(
                f"| {s} | {cp} | {r['whole_s'] * 1e3:.1f} ({lo * 1e3:.1f}-{hi * 1e3:.1f}) | {r['rank_s'] * 1e3:.1f} | "
                f"{r['ratio']:.3f} ({1 / cp:.3f}) | {mib(r['whole_peak'])} | {mib(r['rank_peak'])} | "
                f"{r['err_chunked_whole']:.2e} | {r['err_whole_ref']:.2e} | {r['err_chunked_ref']:.2e} |"
            )
            print(lines[-1], flush=True)
    body = (
        f"{name}, bf16, b {args.batch}, {args.heads} heads, {args.kv_heads} KV heads, head size {args.head_dim}, "
        f"causal, kernel sdpa (cp_kernels: flash), median of {args.reps}.\n\n" + "\n".join(lines)
    )
    print(body)
    if args.markdown:
        write_markdown(
            args.markdown,
            "Chunked ring attention vs one kernel call, one device",
            "python benchmarks/gpu_cp_kernel.py",
            body,
        )


if __name__ == "__main__":
    main()
