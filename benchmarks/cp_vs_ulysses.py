"""ds_megatron context parallelism against DeepSpeed's Ulysses (ALST) at the same shape, process count and degree:
tokens/s and saved activation bytes per rank, interleaved in one run.

    python benchmarks/cp_vs_ulysses.py [--world 2] [--seq 4096] [--reps 4] [--markdown OUT.md]

Ulysses is run the way a long-context DeepSpeed user runs it: transformers' ``LlamaForCausalLM`` with
``attn_implementation="sdpa"``, ``UlyssesSPAttentionHF.register_with_transformers`` (which puts its all-to-all
wrapper in place of transformers' sdpa attention and builds DeepSpeed's sequence-parallel groups), and batches from
``UlyssesSPDataLoaderAdapter`` (each rank gets its shard of ``input_ids``, ``position_ids`` and ``shift_labels``);
the loss is the mean cross entropy of the rank's shard against ``shift_labels``.  ds_megatron runs the training
path's pipeline layers (``benchmarks/cp_memory.py``'s ``RankModel``) at cp = world (ring and a2a) and tp = world
(sequence parallel), on each rank's ``split_window`` chunks.  Same Llama shape (the weights differ: both random),
same kernel (sdpa: torch's CPU flash kernel on both sides), bf16 weights and activations, no recompute.

A step is forward, backward and an all-reduce (average) of every gradient over the world, as the data-parallel
reduction of a training step would (the ranks of both systems are replicas of the same weights; tp ranks hold
shards, so tp skips it); no optimizer step.  Systems run in turn within each repetition (one warm-up repetition
first, not counted), so load from other processes on the machine falls on all of them alike.  Reported: the median
and min-max over repetitions of the slowest rank's wall time, and of the CPU seconds of all ranks per step
(``time.process_time``: on a shared, oversubscribed machine the work a step costs, where wall time also counts
other processes' turns).  With ``--launches K`` the whole measurement runs K times in fresh processes and each
system's ratio to Ulysses is the median of the K launches' own ratios (with their range).  Steps are timed at
glibc's default allocator (the memory probes set their mmap threshold in their own process only).  Saved bytes:
every storage saved for backward during one forward, counted once, parameters excluded.

``--budget-mib M`` measures instead the longest sequence within M MiB of peak resident memory per process for
Ulysses and for ds_megatron's cp and tp (``benchmarks/cp_memory.py``'s search and probe, its budget shape, fp32).

``--head-limit-mib M`` (4 processes) measures the same at a head count where Ulysses' degree stops below the process
count: Qwen2.5-0.5B's attention layout, 14 query heads and 2 KV heads (width scaled down).  Ulysses' degree must
divide the query heads, so at 4 processes its best layout is sp 2 x dp 2 (each sequence split 2 ways; sp 4 is
refused by DeepSpeed, and the refusal is recorded in the same run), while ds_megatron splits each sequence 4 ways:
tp 2 x cp 2 with sequence parallelism (tp needs 14 and 2 divisible by 2) and cp 4 with the ring (no head rule).
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import OtherWork, write_markdown  # noqa: E402
from cp_memory import SHAPE, RankModel, SavedCounter, run_config, window_for  # noqa: E402

DTYPE = torch.bfloat16


class Ulysses:
    """transformers' Llama under DeepSpeed's Ulysses sequence parallelism over the whole world."""

    def __init__(self, world: int, seq: int | None, shape: dict = SHAPE, dtype: torch.dtype = DTYPE):
        """``seq`` None: any sequence length (DeepSpeed's ``seq_length_is_variable``)."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=shape["vocab"],
            hidden_size=shape["hidden"],
            intermediate_size=shape["inter"],
            num_hidden_layers=shape["layers"],
            num_attention_heads=shape["heads"],
            num_key_value_heads=shape["kv_heads"],
            max_position_embeddings=seq or 1 << 20,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            attention_dropout=0.0,
        )
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(cfg).to(dtype)
        self.model.train()
        self.world = world
        self.name = f"DeepSpeed Ulysses sp {world}" if world > 1 else "transformers Llama, 1 process (no Ulysses)"
        self.calls = 0
        if world == 1:  # the baseline both sides start from: each model on one process, no sequence split
            return
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            self.model, "sdpa", world, 1, seq_length=seq, seq_length_is_variable=seq is None
        )
        self.group = mpu.get_sequence_parallel_group()
        self.rank = mpu.get_sequence_parallel_rank()
        self.adapter_cls = UlyssesSPDataLoaderAdapter
        # Count the all-to-all gathers of Ulysses' attention, so a run where transformers bypassed the wrapper
        # (attention over the local shard only: faster and wrong) is refused instead of reported.
        combine = UlyssesSPAttentionHF._combine_local_sequences

        def counted(uattn, *a):
            self.calls += 1
            return combine(uattn, *a)

        UlyssesSPAttentionHF._combine_local_sequences = counted

    def batch(self, window: torch.Tensor) -> dict:
        """This rank's shard of ``window`` ([1, s + 1]) through DeepSpeed's data loader adapter."""
        if self.world == 1:
            return {
                "input_ids": window[:, :-1],
                "position_ids": torch.arange(window.shape[1] - 1).unsqueeze(0),
                "shift_labels": window[:, 1:],
            }
        sample = {
            "input_ids": window[:, :-1],
            "position_ids": torch.arange(window.shape[1] - 1).unsqueeze(0),
            # transformers' convention, labels = inputs: the adapter shifts them over the whole sequence
            # (labels[..., 1:], the last padded with -100) into shift_labels before sharding.
            "labels": window[:, :-1].clone(),
        }
        adapter = self.adapter_cls([sample], self.rank, self.group, self.world, torch.device("cpu"))
        return next(adapter)  # the first micro-batch: sample 0 (every rank's loader yields the same window)

    def loss(self, batch: dict) -> torch.Tensor:
        logits = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        return F.cross_entropy(logits.float().flatten(0, 1), batch["shift_labels"].flatten(), ignore_index=-100)

    def parameters(self):
        return self.model.parameters()


class Megatron:
    """ds_megatron's pipeline layers at tp x cp = world."""

    def __init__(self, tp: int, cp: int, seq: int, comm: str):
        self.run = run_config(tp, cp, seq, SHAPE, comm=comm)
        torch.manual_seed(0)
        self.model = RankModel(self.run, DTYPE)
        self.name = f"ds_megatron tp {tp} x cp {cp}" + (f" {comm}" if cp > 1 else "") + (" SP" if tp > 1 else "")
        if tp * cp == 1:
            self.name = "ds_megatron, 1 process (cp 1)"
        self.reduce = cp > 1  # CP ranks are replicas of the weights; TP ranks hold shards (nothing to average)

    def batch(self, window: torch.Tensor):
        return self.model.split(window)

    def loss(self, batch) -> torch.Tensor:
        return self.model.forward(*batch)

    def parameters(self):
        return self.model.layers.parameters()


def step(system, batch, world: int, counter: SavedCounter | None = None) -> None:
    if counter is not None:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            loss = system.loss(batch)
    else:
        loss = system.loss(batch)
    loss.backward()
    if getattr(system, "reduce", True):
        for p in system.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
    for p in system.parameters():
        p.grad = None


def worker(rank: int, world: int, port: int, args: dict, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # Ulysses' collectives run on deepspeed.comm
    seq = args["seq"]
    systems = [Ulysses(world, seq)]
    for tp, cp, comm in args["layouts"]:
        systems.append(Megatron(tp, cp, seq, comm))
    window = window_for(systems[-1].run, SHAPE["vocab"])
    batches = [s.batch(window) for s in systems]

    saved = []
    for s, b in zip(systems, batches, strict=True):
        counter = SavedCounter({p.untyped_storage().data_ptr() for p in s.parameters()})
        step(s, b, world, counter)
        saved.append(sum(counter.every.values()))
    assert systems[0].calls == (SHAPE["layers"] if world > 1 else 0), (
        f"Ulysses attention ran {systems[0].calls} times in one forward"
    )
    systems[0].calls = 0
    times: list[list[float]] = [[] for _ in systems]
    cpu: list[list[float]] = [[] for _ in systems]
    for rep in range(args["reps"] + 1):  # the first repetition warms up and is not counted
        for i, (s, b) in enumerate(zip(systems, batches, strict=True)):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step(s, b, world)
            dt = torch.tensor([time.perf_counter() - t0])
            dc = torch.tensor([time.process_time() - c0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
            dist.all_reduce(dc)  # CPU seconds of all ranks: the work, whatever else runs on the machine
            if rep:
                times[i].append(dt.item())
                cpu[i].append(dc.item())
    peak_saved = torch.tensor(saved, dtype=torch.float64)
    dist.all_reduce(peak_saved, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put([(s.name, t, c, b) for s, t, c, b in zip(systems, times, cpu, peak_saved.tolist(), strict=True)])
    dist.destroy_process_group()


def budget_worker(rank: int, world: int, port: int, args: dict, queue) -> None:
    """The longest sequence within the budget for Ulysses sp = world and for ds_megatron cp = world (ring) and
    tp = world (sequence parallel), at cp_memory.py's budget shape, fp32, forward + backward, peak resident memory."""
    import cp_memory

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    shape, budget = cp_memory.BUDGET_SHAPE, args["budget_mib"] * 2**20
    uly = Ulysses(world, None, shape, torch.float32)
    probes: list[tuple[int, int]] = []

    def fits(seq: int) -> bool:
        g = torch.Generator().manual_seed(0)
        batch = uly.batch(torch.randint(0, shape["vocab"], (1, seq + 1), generator=g))
        uly.calls = 0
        peak = cp_memory.peak_of(lambda: uly.loss(batch).backward(), uly.parameters)
        assert uly.calls == shape["layers"], f"Ulysses attention ran {uly.calls} times in one forward"
        probes.append((seq, peak))
        return peak <= budget

    results = [(uly.name, cp_memory.longest_within(fits, 1024 * world, 2 * world), probes)]
    for tp, name in ((1, f"ds_megatron cp {world} ring"), (world, f"ds_megatron tp {world} SP")):
        common = {"budget_mib": args["budget_mib"], "dtype": "fp32", "comm": "ring", "start": 1024, "tp": tp}
        got = cp_memory.budget_worker(None, rank, world, common)
        results.append((name, got["longest"], got["probes"]))
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


# Qwen2.5-0.5B's (and Qwen2-0.5B's) attention layout, 14 query heads sharing 2 KV heads, at head size 8, with the
# budget shape's wide MLP and small vocabulary so that activations dominate and long sequences stay cheap on 2 cores.
HEAD_LIMIT_SHAPE = dict(hidden=112, heads=14, kv_heads=2, layers=2, inter=1024, vocab=128)
HEAD_LIMIT_LAYOUTS = ((2, "ds_megatron tp 2 x cp 2 ring SP"), (1, "ds_megatron tp 1 x cp 4 ring"))  # (tp, name)


def ulysses_refusal(shape: dict, world: int) -> str:
    """DeepSpeed's own refusal of Ulysses sp = ``world`` at ``shape``'s head counts ("" if it accepts)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    try:
        UlyssesSPAttentionHF(
            attn=None,
            batch_size=1,
            attn_head_count=shape["heads"],
            attn_head_size=shape["hidden"] // shape["heads"],
            kv_head_count=shape["kv_heads"],
            num_hidden_layers=shape["layers"],
            process_group=dist.group.WORLD,
            seq_length_is_variable=True,
        )
    except ValueError as err:
        return str(err)
    return ""


def ulysses_best_degree(heads: int, world: int) -> int:
    """The largest Ulysses degree at ``world`` processes: it must divide both the world and the query heads."""
    return max(sp for sp in range(2, world + 1) if world % sp == 0 and heads % sp == 0)


def head_limit_worker(rank: int, world: int, port: int, args: dict, queue) -> None:
    """The longest sequence within the budget at HEAD_LIMIT_SHAPE: Ulysses at its best degree x dp, then
    ds_megatron's HEAD_LIMIT_LAYOUTS, fp32, forward + backward, peak resident memory (cp_memory.py's probe)."""
    import cp_memory

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    shape, budget = HEAD_LIMIT_SHAPE, args["budget_mib"] * 2**20
    refusal = ulysses_refusal(shape, world)
    sp = ulysses_best_degree(shape["heads"], world)
    uly = Ulysses(sp, None, shape, torch.float32)  # DeepSpeed's groups: sp consecutive ranks, world / sp of them
    probes: list[tuple[int, int]] = []

    def fits(seq: int) -> bool:
        g = torch.Generator().manual_seed(0)
        batch = uly.batch(torch.randint(0, shape["vocab"], (1, seq + 1), generator=g))
        uly.calls = 0
        peak = cp_memory.peak_of(lambda: uly.loss(batch).backward(), uly.parameters)
        assert uly.calls == shape["layers"], f"Ulysses attention ran {uly.calls} times in one forward"
        probes.append((seq, peak))
        return peak <= budget

    start = args["start"] * world
    results = [
        (f"DeepSpeed Ulysses sp {sp} x dp {world // sp}", sp, cp_memory.longest_within(fits, start, 2 * sp), probes)
    ]
    for tp, name in HEAD_LIMIT_LAYOUTS:
        common = {"budget_mib": args["budget_mib"], "dtype": "fp32", "comm": "ring", "tp": tp, "shape": shape}
        got = cp_memory.budget_worker(None, rank, world, {**common, "start": args["start"]})
        results.append((name, world, got["longest"], got["probes"]))
    if rank == 0:
        queue.put({"refusal": refusal, "rows": results})
    dist.destroy_process_group()


def measure(world: int, args: dict, target=None):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target or worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get()
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"rank failed (exit {p.exitcode})")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument(
        "--launches", type=int, default=1, help="fresh process groups, one after another (ratios per launch)"
    )
    ap.add_argument("--budget-mib", type=int, help="instead: the longest sequence within this peak memory per process")
    ap.add_argument(
        "--head-limit-mib", type=int, help="instead: the same at 14 heads, where Ulysses' degree stops below --world"
    )
    ap.add_argument("--markdown")
    args = ap.parse_args()
    w = args.world
    if args.head_limit_mib:
        return head_limit_table(args)
    if args.budget_mib:
        return budget_table(args)
    layouts = {1: [(1, 1, "ring")], 2: [(1, 2, "a2a"), (1, 2, "ring"), (2, 1, "ring")]}.get(
        w, [(2, w // 2, "ring"), (1, w, "ring")]
    )
    load = os.getloadavg()
    with OtherWork() as other:
        launches = [measure(w, {"seq": args.seq, "reps": args.reps, "layouts": layouts}) for _ in range(args.launches)]
    after = os.getloadavg()
    table = launch_table(launches, args.seq)
    body = (
        f"{w} processes (gloo, 1 thread each), s {args.seq}, batch 1, Llama h {SHAPE['hidden']}, {SHAPE['heads']} "
        f"heads ({SHAPE['kv_heads']} KV heads), {SHAPE['layers']} layers, MLP {SHAPE['inter']}, vocabulary "
        f"{SHAPE['vocab']}, bf16, sdpa, no recompute; {args.launches} launch(es) of {args.reps} repetitions after "
        f"one warm-up each, systems interleaved. Load average (1, 5, 15 min) before {load[0]:.1f}, {load[1]:.1f}, "
        f"{load[2]:.1f}; after {after[0]:.1f}, {after[1]:.1f}, {after[2]:.1f}; other work on the machine "
        f"{other.cores:.2f} cores busy on average (its busy CPU time minus this benchmark's); {other.wall:.0f} s."
        f"\n\n{table}\n"
    )
    print(body)
    if args.markdown:
        if not os.path.exists(args.markdown):
            write_markdown(
                args.markdown, "ds_megatron CP against DeepSpeed Ulysses", "python benchmarks/cp_vs_ulysses.py", ""
            )
        with open(args.markdown, "a") as f:
            f.write(
                f"\n## {w} processes, s {args.seq}{loaded_note(other.cores)}\n\n`{command_line()}`, code at "
                f"{code_revision()}\n\n{body}"
            )


def launch_table(launches: list, seq: int) -> str:
    """The markdown table of one or more launches of ``measure``: per system the median step (wall, slowest rank)
    and CPU seconds (all ranks) over every repetition of every launch, and its speed relative to Ulysses as the
    median over launches of each launch's own ratio (min-max over launches).  A launch is a fresh set of processes,
    with its own memory placement and thread scheduling; that luck lasts a process's lifetime and moves a system's
    speed by a few percent for the whole launch, which repetitions within one launch cannot average out."""
    rows = []
    for i, (name, _, _, saved) in enumerate(launches[0]):
        times = [t for launch in launches for t in launch[i][1]]
        cpu = [c for launch in launches for c in launch[i][2]]
        speed = [statistics.median(la[0][1]) / statistics.median(la[i][1]) for la in launches]
        per_cpu = [statistics.median(la[0][2]) / statistics.median(la[i][2]) for la in launches]
        rows.append((name, times, cpu, speed, per_cpu, saved))
    spread = len(launches) > 1
    lines = [
        "| system | median step s (min-max) | tokens/s | x Ulysses speed"
        + (" (median of launches, min-max)" if spread else "")
        + " | CPU s per step, all ranks (min-max) | tokens per CPU s | x Ulysses"
        + (" (median of launches, min-max)" if spread else "")
        + " | saved MiB / rank | x Ulysses saved |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def ratio(values: list[float]) -> str:
        med = statistics.median(values)
        return f"{med:.2f} ({min(values):.2f}-{max(values):.2f})" if spread else f"{med:.2f}"

    for name, times, cpu, speed, per_cpu, saved in rows:
        med, med_cpu = statistics.median(times), statistics.median(cpu)
        lines.append(
            f"| {name} | {med:.2f} ({min(times):.2f}-{max(times):.2f}) | {seq / med:,.0f} | {ratio(speed)} | "
            f"{med_cpu:.2f} ({min(cpu):.2f}-{max(cpu):.2f}) | {seq / med_cpu:,.0f} | {ratio(per_cpu)} | "
            f"{saved / 2**20:.1f} | {saved / rows[0][5]:.2f} |"
        )
    return "\n".join(lines)


def loaded_note(other_cores: float) -> str:
    """A section title's mark for a run while other work kept the machine busy (on average more than a fifth of a
    core besides the benchmark's own processes, by ``OtherWork``): its tokens/s are a sanity check, not a
    measurement to compare with a quiet run's."""
    return f" (loaded machine: other work kept {other_cores:.1f} cores busy)" if other_cores > 0.2 else ""


def command_line() -> str:
    return "python " + " ".join(["benchmarks/cp_vs_ulysses.py", *sys.argv[1:]])


def code_revision() -> str:
    """The git commit the measured code is at, marked when the working tree differs from it."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    run = functools.partial(subprocess.run, cwd=root, capture_output=True, text=True)
    head = run(["git", "rev-parse", "--short", "HEAD"]).stdout.strip() or "unknown"
    return head + (
        " + uncommitted changes" if run(["git", "status", "--porcelain", "--", "ds_megatron"]).stdout else ""
    )


def budget_table(args) -> None:
    from cp_memory import BUDGET_SHAPE as shape

    load, t0 = os.getloadavg(), time.time()
    rows = measure(args.world, {"budget_mib": args.budget_mib}, budget_worker)
    after = os.getloadavg()
    lines = ["| system | longest s within budget | x Ulysses | probes (s: peak MiB) |", "|---|---|---|---|"]
    for name, longest, probes in rows:
        seen = ", ".join(f"{s}: {p / 2**20:.0f}" for s, p in probes)
        lines.append(f"| {name} | {longest} | {longest / rows[0][1] if rows[0][1] else 0:.2f} | {seen} |")
    body = (
        f"### Longest sequence within {args.budget_mib} MiB of peak resident memory per process\n\n"
        f"{args.world} processes, Llama h {shape['hidden']}, {shape['heads']} heads, {shape['layers']} layers, MLP "
        f"{shape['inter']}, vocabulary {shape['vocab']}, batch 1, fp32, sdpa, forward + backward, no recompute; "
        f"search and peak as in cp_memory.md. Load average before {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}; after "
        f"{after[0]:.1f}, {after[1]:.1f}, {after[2]:.1f}; {time.time() - t0:.0f} s.\n\n" + "\n".join(lines) + "\n"
    )
    print(body)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(f"\n{body}")


def head_limit_table(args) -> None:
    shape, world = HEAD_LIMIT_SHAPE, args.world
    load, t0 = os.getloadavg(), time.time()
    got = measure(world, {"budget_mib": args.head_limit_mib, "start": 1024}, head_limit_worker)
    after = os.getloadavg()
    rows = got["rows"]
    base = rows[0][2]
    lines = [
        "| system | ways each sequence is split | longest s within budget | tokens per process | x Ulysses | "
        "probes (s: peak MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for name, ways, longest, probes in rows:
        seen = ", ".join(f"{s}: {p / 2**20:.0f}" for s, p in probes)
        ratio = f"{longest / base:.2f}" if base else "-"
        lines.append(f"| {name} | {ways} | {longest} | {longest // ways} | {ratio} | {seen} |")
    refusal = got["refusal"] or "(accepted)"
    body = (
        f"### Longest sequence within {args.head_limit_mib} MiB per process where Ulysses' degree stops: "
        f"{shape['heads']} heads, {world} processes\n\n"
        f"{world} processes (gloo, 1 thread each), Llama h {shape['hidden']}, {shape['heads']} heads "
        f"({shape['kv_heads']} KV heads: Qwen2.5-0.5B's attention layout), {shape['layers']} layers, MLP "
        f"{shape['inter']}, vocabulary {shape['vocab']}, batch 1, fp32, sdpa, forward + backward, no recompute; "
        f"peak resident memory above the resident set before the step (weights excluded, gradients included), "
        f"search as in cp_memory.md. DeepSpeed on Ulysses sp {world} at this shape, in the same run: "
        f"`{refusal}`. Load average before {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}; after {after[0]:.1f}, "
        f"{after[1]:.1f}, {after[2]:.1f}; {time.time() - t0:.0f} s.\n\n" + "\n".join(lines) + "\n"
    )
    print(body)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(f"\n{body}")


if __name__ == "__main__":
    main()
