"""Each memory-bound piece of a block, eager against compiled (``ds_megatron.model.kernels``): forward + backward CPU
time per call at one block's shapes, and the compile time of its two graphs.

    python benchmarks/compiled_pieces.py [--seq 2048 --hidden 256 --heads 8 --kv-heads 2 --ffn 704] [--markdown OUT]

One thread, bf16 (the gemm_floor step's dtype), the median of ``--repeats`` timings of ``--calls`` calls each, in
CPU time (the process's own clock: a shared machine's other jobs do not count).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _results import write_markdown  # noqa: E402

from ds_megatron.model.kernels import EAGER, compiled_kernels  # noqa: E402
from ds_megatron.model.layers import RMSNormFunction  # noqa: E402
from ds_megatron.model.llama.model import RotaryFunction, SwiGLUFunction, rotary_tables  # noqa: E402


def gelu_body(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def gelu_backward_body(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward(grad, x, approximate="tanh")


class GeluFunction(torch.autograd.Function):
    """GPT-2's GELU as the block's pieces are built (saves its input), to measure what compiling it would gain: the
    model keeps ``F.gelu`` (one aten kernel each way)."""

    @staticmethod
    def forward(ctx, x, kernels):
        ctx.kernels = kernels
        ctx.save_for_backward(x)
        return kernels[0](x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.kernels[1](grad, ctx.saved_tensors[0]), None


def pieces(args, dtype: torch.dtype) -> dict:
    """name -> (function of kernels running forward and backward once)."""
    s, h, d = args.seq, args.hidden, args.hidden // args.heads
    x = torch.randn(s, 1, h, dtype=dtype, requires_grad=True)
    w = torch.ones(h, dtype=dtype, requires_grad=True)
    q = torch.randn(s, 1, args.heads, d, dtype=dtype, requires_grad=True)
    k = torch.randn(s, 1, args.kv_heads, d, dtype=dtype, requires_grad=True)
    cos, sin = rotary_tables(((0, s),), d, 500000.0, None, torch.device("cpu"), dtype)
    gate = torch.randn(s, 1, args.ffn, dtype=dtype, requires_grad=True)
    up = torch.randn(s, 1, args.ffn, dtype=dtype, requires_grad=True)
    fc = torch.randn(s, 1, 4 * h, dtype=dtype, requires_grad=True)
    gy, gq, gk = torch.randn_like(x), torch.randn_like(q), torch.randn_like(k)
    gf, g4 = torch.randn_like(gate), torch.randn_like(fc)

    def rms(kern):
        RMSNormFunction.apply(x, w, 1e-5, kern).backward(gy)

    def rope(kern):
        a, b = RotaryFunction.apply(q, k, cos, sin, kern)
        torch.autograd.backward([a, b], [gq, gk])

    def swiglu(kern):
        SwiGLUFunction.apply(gate, up, kern).backward(gf)

    gelu_eager = (gelu_body, gelu_backward_body)
    gelu_compiled = tuple(torch.compile(f, dynamic=False, fullgraph=True) for f in gelu_eager)

    def gelu(kern):
        GeluFunction.apply(fc.detach().requires_grad_(), gelu_eager if kern is EAGER else gelu_compiled).backward(g4)

    return {
        f"RMSNorm [{s}, 1, {h}]": rms,
        f"rotary q [{s}, 1, {args.heads}, {d}] and k (..., {args.kv_heads}, {d})": rope,
        f"SwiGLU [{s}, 1, {args.ffn}]": swiglu,
        f"GELU [{s}, 1, {4 * h}] (not compiled in the model)": gelu,
    }


def cpu_ms(fn, calls: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            fn()
        times.append((time.process_time() - start) / calls)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--markdown")
    args = ap.parse_args()
    torch.set_num_threads(1)
    compiled = compiled_kernels()
    lines = [
        "| piece (bf16, forward + backward) | eager CPU ms | compiled CPU ms | eager / compiled | compile wall s |",
        "|---|---|---|---|---|",
    ]
    for name, run in pieces(args, torch.bfloat16).items():
        start = time.perf_counter()
        run(compiled)  # compiles the forward and backward graphs
        compile_s = time.perf_counter() - start
        run(EAGER)
        eager = cpu_ms(functools.partial(run, EAGER), args.calls, args.repeats)
        fused = cpu_ms(functools.partial(run, compiled), args.calls, args.repeats)
        lines.append(f"| {name} | {eager:.2f} | {fused:.2f} | {eager / fused:.1f}x | {compile_s:.1f} |")
    load = "/".join(f"{v:.1f}" for v in os.getloadavg())
    body = (
        f"One thread, bf16, CPU time per call (median of {args.repeats} x {args.calls} calls); load average at the "
        f"end {load} on {os.cpu_count()} cores; compile wall time includes waiting for a core.\n\n" + "\n".join(lines)
    )
    print(body)
    if args.markdown:
        write_markdown(
            args.markdown, "The block's memory-bound pieces, eager and compiled", "python " + " ".join(sys.argv), body
        )


if __name__ == "__main__":
    main()
