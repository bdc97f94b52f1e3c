"""On one GPU: the fused output layer + cross entropy against the unfused one, and a Llama block with its
memory-bound pieces compiled (``ds_megatron.model.kernels``) against eager: time and peak memory of forward +
backward, bf16.

    python benchmarks/gpu_kernels.py [--markdown OUT.md] [--device cuda] [--seq 8192 --hidden 4096 --vocab 128256]
                                     [--block-seq 4096 --heads 32 --kv-heads 8 --ffn 14336] [--repeats 5]

The loss at tp 1: ``--seq`` tokens of width ``--hidden`` against a vocabulary of ``--vocab`` (Llama 3 8B's output
layer at s 8,192 by default), the two paths of ``benchmarks/fused_loss.py`` (``loss_of``) on the same weight,
hidden states and targets; its peak set beside the byte count ``fused_loss.predicted`` gives for the shape.  The
block: Llama 3 8B's (h 4,096, 32 heads, 8 KV heads, SwiGLU 14,336) at s ``--block-seq``, b 1, sdpa attention, eager
against compiled bodies (the first compiled call compiles: its time is reported apart).

Time: CUDA events around one forward + backward, the median of ``--repeats`` after a warm-up call that also
allocates the parameters' gradients (so the peak counts what a step makes, not the gradients' first allocation).
Peak: ``torch.cuda.max_memory_allocated`` over the call minus the bytes allocated before it (weights, inputs and
gradients excluded).  ``--device cpu`` runs the same code as a smoke test of the script (wall time, no peak).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from _results import write_markdown  # noqa: E402
from fused_loss import loss_of, predicted  # noqa: E402

from ds_megatron.model.kernels import EAGER, compile_report, compiled_kernels, use_kernels  # noqa: E402
from ds_megatron.model.llama import LlamaConfig  # noqa: E402
from ds_megatron.model.llama.model import LlamaBlock  # noqa: E402
from ds_megatron.tensor_parallel.fused_cross_entropy import chunk_tokens  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], None], device: torch.device) -> float:
    """One call's time: CUDA events on a GPU, the wall clock elsewhere."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync(device)
    begin.record()
    fn()
    end.record()
    sync(device)
    return begin.elapsed_time(end) / 1e3


def peak_bytes(fn: Callable[[], None], device: torch.device) -> int | None:
    """The most bytes allocated during one call beyond those allocated before it (None off a GPU)."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def measure(fn: Callable[[], None], device: torch.device, repeats: int) -> dict[str, float | int | None]:
    first = seconds(fn, device)  # warm-up: compiles (if compiled) and allocates the gradients
    peak = peak_bytes(fn, device)
    times = [seconds(fn, device) for _ in range(repeats)]
    return {"first_s": first, "s": statistics.median(times), "peak": peak}


def loss_rows(args, device: torch.device) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16
    weight = (0.02 * torch.randn(args.vocab, args.hidden, generator=g, device=device)).to(dtype).requires_grad_()
    hidden = torch.randn(args.seq, 1, args.hidden, generator=g, device=device).to(dtype).requires_grad_()
    target = torch.randint(0, args.vocab, (args.seq, 1), generator=g, device=device)
    _, _, peak_unfused, peak_fused = predicted(args.seq, args.hidden, args.vocab, chunk_tokens(args.vocab), 2)
    rows = []
    for path, expected in (("unfused", peak_unfused), ("fused", peak_fused)):
        result = measure(
            lambda path=path: loss_of(path, hidden, weight, target, args.vocab).backward(), device, args.repeats
        )
        rows.append({"what": f"loss, {path}", "predicted_peak": expected, **result})
    return rows


def block_rows(args, device: torch.device) -> list[dict]:
    config = LlamaConfig(
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=args.ffn,
        num_layers=1,
        max_position_embeddings=args.block_seq,
        attention="sdpa",
    )
    torch.manual_seed(0)
    block = LlamaBlock(config).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(args.block_seq, 1, args.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    rows = []
    for name, kernels in (("eager", EAGER), ("compiled", compiled_kernels())):
        use_kernels(block, kernels)
        result = measure(lambda: block(x).backward(grad), device, args.repeats)
        rows.append({"what": f"Llama block, {name}", "predicted_peak": None, **result})
    return rows


def table(rows: list[dict], device: torch.device) -> str:
    def gb(b: int | None) -> str:
        return "-" if b is None else f"{b / 1e9:.2f}"

    lines = [
        "| what | ms (median) | first call ms | peak GB | predicted peak GB | vs the other path |",
        "|---|---|---|---|---|---|",
    ]
    for i, row in enumerate(rows):
        other = rows[i - 1] if i % 2 else None
        ratio = ""
        if other is not None:
            ratio = f"time {row['s'] / other['s']:.2f}x"
            if row["peak"] and other["peak"]:
                ratio += f", peak {row['peak'] / other['peak']:.2f}x"
        lines.append(
            f"| {row['what']} | {row['s'] * 1e3:.1f} | {row['first_s'] * 1e3:.1f} | {gb(row['peak'])} | "
            f"{gb(row['predicted_peak'])} | {ratio} |"
        )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"Device: {name}, torch {torch.__version__}.\n\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--block-seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--markdown")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    rows = loss_rows(args, device) + block_rows(args, device)
    text = table(rows, device)
    report = compile_report()
    body = text + (f"\n\n{report}" if report else "")
    print(body)
    if args.markdown:
        command = "python benchmarks/gpu_kernels.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_markdown(args.markdown, "Fused loss and compiled block on one GPU", command, body)


if __name__ == "__main__":
    main()
