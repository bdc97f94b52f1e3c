"""The routed experts' GEMMs: torch._grouped_mm (one kernel per projection over all experts) against a loop of
per-expert GEMMs, forward + backward of one ``model.moe_layer.SparseMoeBlock``, per shape and dtype.

    OMP_NUM_THREADS=1 python benchmarks/moe_gemm.py [--repeats 5] [--markdown benchmarks/results/moe_gemm.md]

CPU time of the process (its own clock: wall time on a shared machine also counts other jobs), median of
``--repeats`` after one warm-up; the router is seeded so both paths route the same tokens to the same experts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks._results import write_markdown
from ds_megatron.model.moe_layer import SparseMoeBlock

# (name, tokens, h, F, E, k): moe-tiny's layer at s 256, b 2; a mid layer (Qwen3-30B-A3B's E 128, k 8 scaled down)
SHAPES = (("tiny", 512, 128, 64, 8, 2), ("mid", 4096, 1024, 512, 16, 4))


def step_seconds(block: SparseMoeBlock, x: torch.Tensor, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        xi = x.detach().requires_grad_()
        t0 = time.process_time()
        out, stats = block(xi)
        out.backward(torch.ones_like(out))
        if i:
            times.append(time.process_time() - t0)
        block.zero_grad(set_to_none=True)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    rows = ["| shape | tokens, h, F, E, k | dtype | grouped ms | loop ms | loop / grouped |", "|---" * 6 + "|"]
    for name, n, h, f, e, k in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            block = SparseMoeBlock(h, f, e, k, norm_topk_prob=True)
            with torch.no_grad():
                for p in block.parameters():
                    p.normal_(0.0, 0.02)
            block = block.to(dtype)
            x = torch.randn(n, h, dtype=dtype)
            ms = {}
            for kind in ("grouped", "loop"):
                block.experts.gemm = kind
                ms[kind] = 1e3 * step_seconds(block, x, args.repeats)
            ratio = ms["loop"] / ms["grouped"]
            rows.append(
                f"| {name} | {n}, {h}, {f}, {e}, {k} | {str(dtype)[6:]} | {ms['grouped']:.1f} | {ms['loop']:.1f} "
                f"| {ratio:.2f} |"
            )
            print(rows[-1], flush=True)
    if args.markdown:
        cmd = "OMP_NUM_THREADS=1 python benchmarks/moe_gemm.py"
        write_markdown(args.markdown, "MoE experts: grouped GEMM vs a loop of GEMMs", cmd, "\n".join(rows))


if __name__ == "__main__":
    main()
