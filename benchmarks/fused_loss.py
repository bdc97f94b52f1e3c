"""The output layer + cross entropy, fused (chunks of tokens, ``tensor_parallel.fused_cross_entropy``) against
unfused (logits [N, V], then the vocab-parallel loss): peak memory, bytes saved for backward and CPU time.

    python benchmarks/fused_loss.py [--seq 2048 --hidden 256 --vocab 128256 --repeats 3] [--markdown OUT.md]

One process, tp 1, one thread.  Per dtype (fp32, bf16), the two paths alternate (``--repeats`` each) on the same
weight [V, h], hidden states [s, 1, h] and targets, forward and backward of the mean loss:
- CPU time: the process's CPU clock around forward + backward (the machine is shared: wall time would count the
  time other jobs hold the core);
- peak: the most bytes in use by the C allocator (glibc ``mallinfo2``: arena plus mmap'ed blocks), sampled before
  and after every aten op of forward + backward (a dispatch mode), minus the bytes in use before the forward: every
  tensor the loss makes, its gradients included, at op granularity;
- saved: what autograd keeps between forward and backward (every storage saved once, parameters and the hidden
  states excluded), through ``saved_tensors_hooks``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _results import OtherWork, write_markdown  # noqa: E402

from ds_megatron.tensor_parallel import vocab_parallel_cross_entropy  # noqa: E402
from ds_megatron.tensor_parallel.fused_cross_entropy import (  # noqa: E402
    CHUNK_LOGIT_BYTES,
    chunk_tokens,
    fused_vocab_parallel_loss,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def bytes_in_use() -> int:
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


class PeakBytes(TorchDispatchMode):
    """The most bytes in use, sampled around every aten op dispatched inside."""

    def __enter__(self):
        self.base = self.peak = bytes_in_use()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.peak = max(self.peak, bytes_in_use())
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, bytes_in_use())
        return out


def loss_of(path: str, hidden, weight, target, vocab: int) -> torch.Tensor:
    if path == "fused":
        return fused_vocab_parallel_loss(hidden, weight, target, None, 0, vocab, False)
    logits = hidden.matmul(weight.t())  # what the unfused output layer makes: [s, b, V] in the weights' dtype
    return vocab_parallel_cross_entropy(logits, target, None, 0).mean()


def saved_bytes(path: str, hidden, weight, target, vocab: int) -> int:
    seen, total = {id(weight), id(hidden)}, [0]
    ptrs = {weight.untyped_storage().data_ptr(), hidden.untyped_storage().data_ptr()}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in ptrs and id(t) not in seen:
            ptrs.add(ptr)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(path, hidden, weight, target, vocab)
    loss.backward()
    return total[0]


def one_run(path: str, hidden, weight, target, vocab: int, peak: bool) -> tuple[float, int]:
    hidden.grad = weight.grad = None
    mode = PeakBytes() if peak else None
    t0 = time.process_time()
    if mode is not None:
        with mode:
            loss_of(path, hidden, weight, target, vocab).backward()
    else:
        loss_of(path, hidden, weight, target, vocab).backward()
    return time.process_time() - t0, (mode.peak - mode.base) if mode is not None else 0


def measure(args, dtype: torch.dtype) -> dict[str, dict[str, float]]:
    g = torch.Generator().manual_seed(0)
    weight = (0.02 * torch.randn(args.vocab, args.hidden, generator=g)).to(dtype).requires_grad_()
    hidden = torch.randn(args.seq, 1, args.hidden, generator=g).to(dtype).requires_grad_()
    target = torch.randint(0, args.vocab, (args.seq, 1), generator=g)
    out: dict[str, dict[str, float]] = {p: {"cpu": [], "peak": 0, "saved": 0} for p in ("unfused", "fused")}
    for path in out:
        out[path]["saved"] = saved_bytes(path, hidden, weight, target, args.vocab)
        out[path]["peak"] = one_run(path, hidden, weight, target, args.vocab, peak=True)[1]
    for _ in range(args.repeats):
        for path in out:
            out[path]["cpu"].append(one_run(path, hidden, weight, target, args.vocab, peak=False)[0])
    for path in out:
        out[path]["cpu"] = min(out[path]["cpu"])
    return out


def gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def predicted(n: int, h: int, v: int, c: int, act: int, t: int = 1) -> tuple[int, int, int, int]:
    """(saved unfused, saved fused, peak unfused, peak fused) in bytes for N tokens, this rank's V rows, chunks of
    ``c`` tokens and activations of ``act`` bytes; the weight and its gradient are counted on neither side.
    Unfused: saved the fp32 softmax [N, V] and the hidden states; at peak the logits, their fp32 copy (none in
    fp32), the fp32 softmax and the logits' gradient in their dtype.  Fused: saved dh [N/t, h] (SP) and dW [V, h];
    at peak besides, the fp32 accumulator of dW (the saved dW itself in fp32), one chunk's product D^T h [V, h],
    one chunk's fp32 logits with the bf16 ones or with their bf16 gradient (6 bytes each; 4 in fp32, where the
    copy and the cast are the same buffer) and, at tp > 1, dh [N, h] before its reduction."""
    saved_u = 4 * n * v + act * n * h
    saved_f = act * n * h // t + act * v * h
    wide = act != 4  # fp32 models: the fp32 copy of the logits and the fp32 dW accumulator are the same buffers
    peak_u = (act + (4 if wide else 0) + 4 + act) * n * v
    peak_f = saved_f + (4 * v * h if wide else 0) + act * v * h + (4 + (act if wide else 0)) * min(c, n) * v
    peak_f += act * n * h if t > 1 else 0
    return saved_u, saved_f, peak_u, peak_f


def extrapolation(s: int, h: int, v: int) -> str:
    """Both paths at the target shape, bf16: tp 1, tp 2 with SP (this rank's V/2 rows), and the 128k recipe's shard
    (ds_configs/llama3_8b_128k.json: 131,072 tokens over cp 8 = 16,384 per rank, tp 2 with SP, h 4,096)."""
    rows = []
    shapes = (
        (f"V {v:,}, tp 1, s {s:,}", s, v, 1),
        (f"V/t {v // 2:,} (tp 2, SP), s {s:,}", s, v // 2, 2),
        (f"128k recipe: V/t {v // 2:,} (tp 2, SP), 16,384 tokens per CP rank", 16_384, v // 2, 2),
    )
    for label, n, vloc, t in shapes:
        c = chunk_tokens(vloc)
        su, sf, pu, pf = predicted(n, h, vloc, c, 2, t)
        rows.append(f"| {label}, h {h:,}, bf16 | {gb(su)} | {gb(sf)} | {gb(pu)} | {gb(pf)} | {c} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--markdown")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    c = chunk_tokens(args.vocab)
    with OtherWork() as other:
        for name in args.dtypes:
            r = measure(args, DTYPES[name])
            u, f = r["unfused"], r["fused"]
            su, sf, pu, pf = predicted(args.seq, args.hidden, args.vocab, c, DTYPES[name].itemsize)
            counted = {"unfused": (pu, su), "fused": (pf, sf)}
            for path, m in r.items():
                rows.append(
                    f"| {name} | {path} | {gb(m['peak'])} ({gb(counted[path][0])}) | {gb(m['saved'])} "
                    f"({gb(counted[path][1])}) | {m['cpu'] * 1e3:,.0f} |"
                    + (
                        f" {u['peak'] / max(f['peak'], 1):.1f}x less peak, {u['saved'] / max(f['saved'], 1):.1f}x less"
                        f" saved, CPU {f['cpu'] / u['cpu']:.2f}x |"
                        if path == "fused"
                        else " |"
                    )
                )
                print(rows[-1], flush=True)
    body = (
        f"Output layer + mean cross entropy, one micro-batch: s {args.seq:,}, b 1, h {args.hidden}, V {args.vocab:,}"
        f" (tp 1, untied weight [V, h]); fused chunks of {c} tokens ({CHUNK_LOGIT_BYTES // 2**20} MiB of fp32 logits "
        f"each); one process, one thread; CPU time best of {args.repeats}, paths alternating.  Other work on the "
        f"machine meanwhile: {other.cores:.1f} cores busy of {os.cpu_count()} on average.\n\n"
        "Measured, with the byte count of ``predicted`` (below) in parentheses:\n\n"
        "| dtype | path | peak GB (allocator, forward + backward) | saved for backward GB | CPU ms fwd + bwd | "
        "fused vs unfused |\n|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        "Extrapolated to the target shapes by the same byte counts (GB; ``predicted`` in benchmarks/fused_loss.py: "
        "unfused saves the fp32 softmax [N, V/t] and the hidden states and peaks with the logits, their fp32 copy, "
        "the softmax and the logits' gradient alive; fused saves dh [N/t, h] and dW [V/t, h] in bf16 and peaks "
        "with the fp32 dW accumulator, one chunk's product and logits and, at tp 2, dh before its "
        "reduce-scatter; the weight and its gradient are counted on neither side):\n\n"
        "| shape | saved unfused | saved fused | peak unfused | peak fused | tokens per chunk |\n"
        "|---|---|---|---|---|---|\n" + extrapolation(8192, 4096, args.vocab) + "\n"
    )
    print(body)
    if args.markdown:
        cmd = "python benchmarks/fused_loss.py " + " ".join(sys.argv[1:])
        write_markdown(args.markdown, "Fused output layer + cross entropy: memory and CPU time", cmd, body)


if __name__ == "__main__":
    main()
