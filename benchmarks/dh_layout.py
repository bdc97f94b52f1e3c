"""The layout of W in the output layer's input gradient, dh = D W (D: the gradient of the logits [N, V], W the
output table [V, h]), on CPU: W as stored (row-major, K = V inner) against a column-major copy
(``fused_cross_entropy.dh_operand``), on both loss paths.

    python benchmarks/dh_layout.py [--shapes 2048,256,8192 512,1024,32000] [--repeats 3] [--markdown OUT.md]

One process, tp 1, one thread, bf16.  Per shape (s, h, V):
- the dh GEMM alone, mm(D, W) with W row-major and column-major, and the copy that makes the column-major W;
- the unfused path (``model.fused_loss`` false: the logits h W^T, then the vocabulary-parallel cross entropy),
  forward and backward, its dh by autograd's linear backward (W as stored) against the same with dh = D x the
  column-major copy (made in backward, once, as the fused loss does once per micro-batch);
- the fused path (``model.fused_loss``, the default) with ``dh_operand`` as shipped against W as stored.
Each A/B alternates its two variants ``--repeats`` times on the same inputs (CPU time of the process: the machine
is shared) and checks that the loss, dh and dW are bit-equal between them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _results import OtherWork, write_markdown  # noqa: E402

from ds_megatron.tensor_parallel import fused_cross_entropy, vocab_parallel_cross_entropy  # noqa: E402
from ds_megatron.tensor_parallel.fused_cross_entropy import dh_operand, fused_vocab_parallel_loss  # noqa: E402


class _ColumnMajorDhLinear(torch.autograd.Function):
    """y = x W^T (F.linear without bias) whose input gradient is dY x the column-major copy of W."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g2, x2 = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = g2.mm(dh_operand(weight)).view(x.shape)
        return grad_x, g2.t().mm(x2)


def unfused(hidden, weight, target, column_major: bool) -> torch.Tensor:
    logits = _ColumnMajorDhLinear.apply(hidden, weight) if column_major else F.linear(hidden, weight)
    return vocab_parallel_cross_entropy(logits, target, None, 0).mean()


def fused(hidden, weight, target, column_major: bool) -> torch.Tensor:
    shipped = fused_cross_entropy.dh_operand
    fused_cross_entropy.dh_operand = shipped if column_major else (lambda w: w)
    try:
        return fused_vocab_parallel_loss(hidden, weight, target, None, 0, weight.shape[0], False)
    finally:
        fused_cross_entropy.dh_operand = shipped


def run(path, hidden, weight, target, column_major: bool) -> tuple[float, tuple]:
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    start = time.process_time()
    loss = path(h, w, target, column_major)
    loss.backward()
    return time.process_time() - start, (loss.detach(), h.grad, w.grad)


def ab(fn_a, fn_b, repeats: int) -> tuple[float, float, bool]:
    """Median CPU s of a and b, alternated after one warm-up each, and whether their results are bit-equal."""
    fn_a(), fn_b()
    times_a, times_b, equal = [], [], True
    for _ in range(repeats):
        ta, ra = fn_a()
        tb, rb = fn_b()
        times_a.append(ta)
        times_b.append(tb)
        equal = equal and all(torch.equal(x, y) for x, y in zip(ra, rb))
    return statistics.median(times_a), statistics.median(times_b), equal


def shape_rows(s: int, h: int, v: int, repeats: int) -> list[str]:
    torch.manual_seed(0)
    dtype = torch.bfloat16
    hidden = torch.randn(s, 1, h, dtype=dtype)
    weight = (torch.randn(v, h) * h**-0.5).to(dtype)
    target = torch.randint(0, v, (s, 1))
    d = torch.randn(s, v, dtype=dtype)

    def gemm(w):
        def one():
            start = time.process_time()
            out = d.mm(w)
            return time.process_time() - start, (out,)

        return one

    def copy():
        start = time.process_time()
        out = dh_operand(weight)
        return time.process_time() - start, (out,)

    rows = []
    row_s, col_s, equal = ab(gemm(weight), gemm(dh_operand(weight)), repeats)
    copy_s = ab(copy, copy, repeats)[0]
    flops = 2 * s * v * h
    rows.append(
        f"| s {s}, h {h}, V {v} | dh GEMM alone | {row_s * 1e3:,.1f} ({flops / row_s / 1e9:.0f} GFLOP/s) | "
        f"{col_s * 1e3:,.1f} ({flops / col_s / 1e9:.0f} GFLOP/s) + copy {copy_s * 1e3:,.1f} | "
        f"{(col_s + copy_s) / row_s:.2f} | {'yes' if equal else 'no'} |"
    )
    for name, path in (("unfused loss, forward + backward", unfused), ("fused loss, forward + backward", fused)):
        row_s, col_s, equal = ab(
            lambda p=path: run(p, hidden, weight, target, False),
            lambda p=path: run(p, hidden, weight, target, True),
            repeats,
        )
        rows.append(
            f"| s {s}, h {h}, V {v} | {name} | {row_s * 1e3:,.1f} | {col_s * 1e3:,.1f} | {col_s / row_s:.2f} | "
            f"{'yes' if equal else 'no'} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["2048,256,8192", "512,1024,32000"], help="s,h,V")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--markdown")
    args = p.parse_args()
    torch.set_num_threads(1)
    lines = [
        "| shape | what | W as stored (row-major): CPU ms | column-major W: CPU ms | column-major / row-major "
        "| bit-equal |",
        "|---|---|---|---|---|---|",
    ]
    with OtherWork() as other:
        for shape in args.shapes:
            s, h, v = (int(x) for x in shape.split(","))
            lines += shape_rows(s, h, v, args.repeats)
    body = (
        f"bf16, one process, one thread, median CPU time of {args.repeats} alternated runs after one warm-up each; "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, AVX512-BF16 "
        f"{'yes' if torch.cpu._is_avx512_bf16_supported() else 'no'}; other work on the machine during the run: "
        f"{other.cores:.2f} cores\n\n" + "\n".join(lines)
    )
    print(body)
    if args.markdown:
        write_markdown(
            args.markdown,
            "The output layer's dh = D W: W as stored against a column-major copy, on CPU",
            "python benchmarks/dh_layout.py " + " ".join(sys.argv[1:]),
            body,
        )


if __name__ == "__main__":
    main()
