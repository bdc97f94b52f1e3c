"""Context parallelism and memory per rank: saved activation bytes at cp 1, 2, 4, and the longest sequence that
trains within a fixed per-process memory budget.

    python benchmarks/cp_memory.py [--seqs 8192 16384 32768] [--cps 1 2 4] [--budget-mib 256] [--markdown OUT.md]

Part 1 (saved bytes): the training path's own pipeline layers (``pipeline.layer_specs``: embedding, rotary
positions, Llama blocks with their CP ``core_attention`` hook, final norm, output and loss), built for a topology
with a CP axis on cp in-process gloo ranks, run one forward on each rank's ``split_window`` chunks under
``torch.autograd.graph.saved_tensors_hooks``; every storage saved for backward is counted once (parameters
excluded), for the blocks alone and for the whole forward.  Saved bytes are deterministic (one run suffices).

Part 2 (budget): at a fixed small shape, forward + backward of the same layers per probe; a probe fits when the
peak resident set of every rank, minus its resident set just before the step, stays within the budget.  The peak
is reset before each probe (``/proc/self/clear_refs`` 5 resets VmHWM) and glibc is told to map every allocation
above 64 KiB and return it on free (``mallopt(M_MMAP_THRESHOLD)``, set by the probe in its own process only), so
one probe's freed memory never hides the next probe's.  The search doubles the sequence until a probe does not
fit, then bisects twice (a resolution of a quarter of the last doubling).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import write_markdown  # noqa: E402

# Part 1's shape (Llama family): h 256, 4 heads (d 64), 2 KV heads, 2 layers.
SHAPE = dict(hidden=256, heads=4, kv_heads=2, layers=2, inter=688, vocab=512)
# Part 2's shape: small attention (h 64, 2 heads) so that long sequences stay cheap to compute on 2 cores, and a
# wide MLP so that activations, not the attention's s^2 work, dominate what is measured.
BUDGET_SHAPE = dict(hidden=64, heads=2, kv_heads=2, layers=2, inter=1024, vocab=128)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run_config(tp, cp, seq, shape, *, comm="ring", attention="sdpa", recompute="none", batch=1):
    from ds_megatron.config import resolve

    model = {
        "family": "llama",
        "num_layers": shape["layers"],
        "hidden_size": shape["hidden"],
        "num_heads": shape["heads"],
        "num_kv_heads": shape["kv_heads"],
        "intermediate_size": shape["inter"],
        "vocab_size": shape["vocab"],
        "seq_length": seq,
        "dropout": 0.0,
        "attention": attention,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    rec = {"policy": "full", "num_layers": 1} if recompute == "full" else {"policy": recompute}
    cfg = {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": batch,
        "ds_megatron": {
            "model": model,
            "parallel": {"tp": tp, "cp": cp, "cp_comm": comm, "sequence_parallel": tp > 1},
            "recompute": rec,
            "train": {"seed": 1234},
        },
    }
    return resolve(cfg, tp * cp)


class RankModel:
    """The training path's pipeline layers on this rank (one pipeline stage, dp 1), as tests/unit/test_cp_training.py
    builds them, in ``dtype``."""

    def __init__(self, run, dtype):
        from torch import nn

        from ds_megatron.model import model_config
        from ds_megatron.parallelize import ParallelContext
        from ds_megatron.pipeline_parallel.module import PipelineLayout, VocabParallelLoss, layer_specs
        from ds_megatron.topology import ParallelTopology

        self.run = run
        self.topo = ParallelTopology.build(run.tp, 1, run.dp, run.cp)
        cfg = model_config(run.model)
        self.ctx = ParallelContext(
            cfg,
            self.topo.tp_axis,
            run.section.parallel.sequence_parallel,
            None,
            recompute=run.section.recompute,
            cp=self.topo.cp_axis,
            cp_comm=run.section.parallel.cp_comm,
        )
        specs = layer_specs(cfg, self.ctx, run.section.train.seed)
        assert not PipelineLayout.of(cfg).tied
        self.layers = nn.ModuleList(spec.build() for spec in specs).to(dtype)
        self.blocks = {i for i, m in enumerate(self.layers) if type(m).__name__ == "BlockPipe"}
        self.loss_fn = VocabParallelLoss(self.ctx)
        self.full = run.section.recompute.policy == "full"
        self.vocab = cfg.vocab_size

    def split(self, window):
        from ds_megatron.context_parallel.layout import split_window

        return split_window(window, self.topo.cp_rank, self.topo.cp)

    def forward(self, ids, labels, counter: SavedCounter | None = None):
        """The loss of this rank's chunks; with ``counter``, every tensor saved for backward is counted."""
        import contextlib

        from ds_megatron.recompute import checkpoint

        hooks = torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t) if counter else None
        with hooks or contextlib.nullcontext():
            x = ids
            for i, layer in enumerate(self.layers):
                if counter:
                    counter.in_block = i in self.blocks
                x = checkpoint(layer, x, rng=None) if self.full and i in self.blocks else layer(x)
            if counter:
                counter.in_block = False
            return self.loss_fn(x.float(), labels)


class SavedCounter:
    """Pack hooks that record each saved storage once (parameters excluded): in ``every`` always, and in
    ``blocks`` while ``in_block`` is set (nested saved-tensor hooks would hide the outer ones, so one hook
    records both)."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.every, self.blocks, self.in_block = exclude, {}, {}, False

    def pack(self, t):
        st = t.untyped_storage()
        if st.data_ptr() not in self.exclude:
            self.every[st.data_ptr()] = st.nbytes()
            if self.in_block:
                self.blocks[st.data_ptr()] = st.nbytes()
        return t


def window_for(run, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (run.global_batch_size, run.model.seq_length + 1), generator=g)


# ---- part 1: saved bytes ------------------------------------------------------------------------------------------


def saved_worker(group, rank, world, args) -> dict:
    out = {}
    for dtype_name in args["dtypes"]:
        for seq in args["seqs"]:
            run = run_config(1, world, seq, SHAPE, comm=args["comm"])
            model = RankModel(run, DTYPES[dtype_name])
            params = {p.untyped_storage().data_ptr() for p in model.layers.parameters()}
            counter = SavedCounter(params)
            ids, labels = model.split(window_for(run, model.vocab))
            loss = model.forward(ids, labels, counter)  # forward only: what it saves is what backward would read
            out[f"{dtype_name}/{seq}"] = (sum(counter.blocks.values()), sum(counter.every.values()))
            del model, loss
    return out


# ---- part 2: longest sequence within a budget ---------------------------------------------------------------------


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _trim():
    ctypes.CDLL("libc.so.6").malloc_trim(0)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def map_large_allocations() -> None:
    """From now on glibc maps every allocation above 64 KiB on its own and unmaps it on free, so the resident set
    follows what is live.  Only this process, and only for the memory probes: it makes every large allocation
    page-fault afresh (in a speed measurement that is system time spent on both sides alike, ~40% of a CPU step
    here, which hides the differences being measured), so it is never set where steps are timed."""
    if not ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) refused")


def peak_of(step, params) -> int:
    """Peak resident bytes of ``step()`` (one forward + backward) above the resident set just before it, the largest
    over the ranks; the gradients of ``params`` are dropped before and after (they belong to the step, not to the
    next probe's baseline)."""
    map_large_allocations()
    for p in params():
        p.grad = None
    _trim()
    base = _current_rss()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets this process's peak resident set (VmHWM) to its current resident set
    step()
    peak = torch.tensor([_peak_rss() - base], dtype=torch.float64)
    for p in params():
        p.grad = None
    _trim()
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def probe_peak(model: RankModel, run) -> int:
    """:func:`peak_of` one forward + backward of ``model`` on a window of ``run``'s sequence length."""
    window = window_for(run, model.vocab)
    ids, labels = model.split(window)
    del window
    return peak_of(lambda: model.forward(ids, labels).backward(), model.layers.parameters)


def longest_within(fits, start: int, step: int) -> int:
    """The longest sequence for which ``fits(seq)`` holds: doubling from ``start`` until it fails, then two
    bisection steps (multiples of ``step``); 0 when ``start`` does not fit."""
    seq = start
    if not fits(seq):
        return 0
    while fits(seq * 2):
        seq *= 2
    lo, hi = seq, seq * 2  # lo fits, hi does not
    for _ in range(2):
        mid = (lo + hi) // 2 // step * step
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def budget_worker(group, rank, world, args) -> dict:
    """The longest sequence at tp x cp = world (``args["tp"]``, default 1) within the budget, with its probes, at
    ``args["shape"]`` (default the budget shape)."""
    budget = args["budget_mib"] * 2**20
    tp = args.get("tp", 1)
    cp = world // tp
    shape = args.get("shape", BUDGET_SHAPE)
    probes = []

    def fits(seq) -> bool:
        run = run_config(tp, cp, seq, shape, comm=args["comm"])
        model = RankModel(run, DTYPES[args["dtype"]])
        peak = probe_peak(model, run)
        probes.append((seq, peak))
        del model
        return peak <= budget

    # s divisible by 2 cp (and by cp x tp under sequence parallelism)
    longest = longest_within(fits, args["start"] * world, 2 * cp * tp)
    return {"probes": probes, "longest": longest}


# ---- spawn --------------------------------------------------------------------------------------------------------


def _worker(rank, world, port, fn_name, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = globals()[fn_name](None, rank, world, args)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def spawn(fn_name: str, world: int, args: dict):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn_name, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get()
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{fn_name} rank failed (exit {p.exitcode})")
    return result


def formula_bytes(seq: int, cp: int, comm: str, dtype: torch.dtype) -> float:
    """memory.py's bytes of the blocks per rank at this shape (sdpa's fused path, no dropout): every layer's
    activations, plus the rotary tables the process's blocks share (once, not per layer)."""
    from ds_megatron.memory import activation_bytes_per_layer, rotary_table_bytes

    act = torch.empty((), dtype=dtype).element_size()
    per_layer = activation_bytes_per_layer(
        seq, 1, SHAPE["hidden"], SHAPE["heads"], act_bytes=act, attention="sdpa", family="llama",
        num_kv_heads=SHAPE["kv_heads"], intermediate_size=SHAPE["inter"], cp=cp, cp_comm=comm,
    )  # fmt: skip
    tables = rotary_table_bytes(seq, SHAPE["hidden"], SHAPE["heads"], cp, family="llama", act_bytes=act)
    return SHAPE["layers"] * per_layer + tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--comm", default="ring")
    ap.add_argument("--budget-mib", type=int, default=256)
    ap.add_argument("--budget-dtype", default="fp32")
    ap.add_argument("--skip-budget", action="store_true")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    t0 = time.time()
    load_before = os.getloadavg()

    saved = {
        cp: spawn("saved_worker", cp, {"dtypes": list(DTYPES), "seqs": args.seqs, "comm": args.comm}) for cp in args.cps
    }
    mib = 2**20
    lines = [
        "| dtype | s | cp | blocks saved MiB / rank | memory.py formula MiB (layers + rotary tables) | "
        "measured / formula | cp 1 / cp MiB | x cp vs cp 1 | whole forward saved MiB / rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype_name in DTYPES:
        for seq in args.seqs:
            ref = saved[1][f"{dtype_name}/{seq}"][0] if 1 in saved else None
            for cp in args.cps:
                blocks, every = saved[cp][f"{dtype_name}/{seq}"]
                ratio = f"{blocks * cp / ref:.3f}" if ref else "-"
                share = f"{ref / cp / mib:.2f}" if ref else "-"
                formula = formula_bytes(seq, cp, args.comm, DTYPES[dtype_name])
                lines.append(
                    f"| {dtype_name} | {seq} | {cp} | {blocks / mib:.2f} | {formula / mib:.2f} | "
                    f"{blocks / formula:.3f} | {share} | {ratio} | {every / mib:.2f} |"
                )
    table1 = "\n".join(lines)
    print(table1, flush=True)

    table2 = ""
    if not args.skip_budget:
        rows = ["| cp | longest s within budget | x cp 1 | probes (s: peak MiB) |", "|---|---|---|---|"]
        base = None
        for cp in args.cps:
            res = spawn(
                "budget_worker",
                cp,
                {"budget_mib": args.budget_mib, "dtype": args.budget_dtype, "comm": args.comm, "start": 1024},
            )
            base = base or res["longest"]
            probes = ", ".join(f"{s}: {p / mib:.0f}" for s, p in res["probes"])
            rows.append(f"| {cp} | {res['longest']} | {res['longest'] / base if base else 0:.2f} | {probes} |")
            print(rows[-1], flush=True)
        table2 = "\n".join(rows)
    load_after = os.getloadavg()
    body = (
        f"Load average (1, 5, 15 min) before {load_before[0]:.1f}, {load_before[1]:.1f}, {load_before[2]:.1f}; "
        f"after {load_after[0]:.1f}, {load_after[1]:.1f}, {load_after[2]:.1f}; {time.time() - t0:.0f} s.\n\n"
        f"## Saved activation bytes per rank\n\nLlama, h {SHAPE['hidden']}, {SHAPE['heads']} heads "
        f"({SHAPE['kv_heads']} KV heads), {SHAPE['layers']} layers, MLP {SHAPE['inter']}, vocabulary "
        f"{SHAPE['vocab']}, batch 1, sdpa, cp_comm {args.comm}, no recompute.\n\n{table1}\n"
    )
    if table2:
        body += (
            f"\n## Longest sequence within {args.budget_mib} MiB of peak resident memory per process\n\n"
            f"Llama, h {BUDGET_SHAPE['hidden']}, {BUDGET_SHAPE['heads']} heads, {BUDGET_SHAPE['layers']} layers, "
            f"MLP {BUDGET_SHAPE['inter']}, vocabulary {BUDGET_SHAPE['vocab']}, batch 1, {args.budget_dtype}, sdpa, "
            f"forward + backward, no recompute.\n\n{table2}\n"
        )
    print(body)
    if args.markdown:
        write_markdown(args.markdown, "Context parallelism: memory per rank", "python benchmarks/cp_memory.py", body)


if __name__ == "__main__":
    main()
