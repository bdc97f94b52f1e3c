"""Llama training at tp 2 on 2 CPU processes: ds_megatron (SP on; recompute selective / none / full) against
DeepSpeed's AutoTP training of transformers' LlamaForCausalLM (``"tensor_parallel": {"autotp_size": 2}``) without
and with transformers' activation checkpointing.

    python benchmarks/throughput_vs_autotp.py [--layers 4 --hidden 256 --heads 8 --kv-heads 2 --ffn 704 --seq 2048
                                              --batch 1 --vocab 8192] [--warmup 2 --steps 16] [--markdown OUT.md]

Both sides: bf16 with ZeRO-1 (DeepSpeed's fp32 master weights), AdamW (lr 1e-4, betas 0.9/0.95, weight decay 0.1 on
matrices), clipping 1.0, eager attention, no dropout, untied output layer, the same initial weights (ds_megatron's,
loaded into the transformers model by name) and the same tokens; the transformers loss is given the shifted labels
so that both predict all s tokens.  Two phases:

1. times: one launch builds all five variants and runs their steps in turn (one round = one step of each, the
   order rotating every round), so machine noise hits every variant alike.  Per step the slowest rank's wall time
   and CPU time (the process's own, which other processes on a shared machine disturb far less); ms/step is the
   median over the steps after warm-up, and each speed ratio also the median of the per-round ratios.
2. memory: one launch per variant (nothing else resident): peak RSS per rank while training (the high-water mark is
   reset after the engine is built, ``/proc/self/clear_refs``), and the bytes saved for backward by one micro-batch
   forward with the loss, measured with ``torch.autograd.graph.saved_tensors_hooks`` as the sum of the unique
   storages saved (parameters excluded).

On CPU the collectives are gloo's, which has no reduce-scatter: ds_megatron's SP reduce-scatter is an all-reduce of
the full tensor followed by this rank's slice, where NCCL would move half the bytes (AutoTP's row-parallel layers
all-reduce on both).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _results import write_markdown  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TP = 2
# name: (system, recompute); the row order of the table.
VARIANTS = {
    "dsm-selective": ("ds_megatron", "selective"),
    "dsm-none": ("ds_megatron", "none"),
    "dsm-full": ("ds_megatron", "full"),
    "autotp-none": ("autotp", "none"),
    "autotp-full": ("autotp", "full"),
}
LABELS = {
    "dsm-selective": "ds_megatron, SP, selective",
    "dsm-none": "ds_megatron, SP, none",
    "dsm-full": "ds_megatron, SP, full (uniform, 1 layer)",
    "autotp-none": "AutoTP, none",
    "autotp-full": "AutoTP, full (HF activation checkpointing)",
}
LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.95), 1e-8, 0.1


# ---------------------------------------------------------------------------------------------------------------
# Worker side (runs under the deepspeed launcher, one process per TP rank).


def deepspeed_keys(args) -> dict:
    """DeepSpeed settings shared by both systems."""
    return {
        "train_batch_size": args.batch,
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def ds_megatron_config(args, recompute: str, attention: str = "eager") -> dict:
    return {
        **deepspeed_keys(args),
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        },
        "ds_megatron": {
            "model": {
                "family": "llama",
                "num_layers": args.layers,
                "hidden_size": args.hidden,
                "num_heads": args.heads,
                "num_kv_heads": args.kv_heads,
                "intermediate_size": args.ffn,
                "vocab_size": args.vocab,
                "seq_length": args.seq,
                "dropout": 0.0,
                "attention": attention,
                "tie_word_embeddings": False,
                "compile": getattr(args, "compile", False),  # gemm_floor.py --compile-ab sets it per engine
            },
            "parallel": {"tp": TP, "pp": 1, "sequence_parallel": True},
            "recompute": {"policy": recompute, "num_layers": 1, "method": "uniform"},
        },
    }


class Variant:
    """One engine, how to train it one step (``train_step``) and its forward with the loss (``forward_loss``)."""

    def __init__(self, name: str, args):
        self.name = name
        system, recompute = VARIANTS[name]
        if system == "ds_megatron":
            self._build_ds_megatron(args, recompute)
        else:
            self._build_autotp(args, recompute)

    def _build_ds_megatron(self, args, recompute: str) -> None:
        from ds_megatron.config import resolve
        from ds_megatron.engine import build_engine

        self.engine = build_engine(resolve(ds_megatron_config(args, recompute), TP)).engine
        self.train_step = lambda x, y: float(self.engine.train_batch(iter([(x, y)])))
        module = self.engine.module
        self.forward_loss = lambda x, y: module.loss_fn(module(x), y)

    def _build_autotp(self, args, recompute: str) -> None:
        from transformers import LlamaForCausalLM

        from ds_megatron.config import resolve
        from ds_megatron.model import build_model, model_config

        run = resolve(ds_megatron_config(args, "none"), TP)
        reference = build_model(model_config(run.model), seed=run.section.train.seed)
        model = LlamaForCausalLM(reference.config.to_hf())
        model.load_state_dict(reference.state_dict())  # LlamaForCausalLM names: the key map is the identity
        del reference
        self.engine, self.train_step, self.forward_loss = autotp_engine(args, model, recompute)


def autotp_engine(args, model, recompute: str):
    """DeepSpeed's AutoTP training engine of transformers' ``model`` at tp ``TP``, the way its users start it, with
    this benchmark's optimizer; returns (engine, train_step(x, y) -> loss, forward_loss(x, y))."""
    import deepspeed

    from ds_megatron.optim import param_groups

    if recompute == "full":
        model.activation_checkpointing_enable()  # transformers 5's name for gradient_checkpointing_enable
    opt = torch.optim.AdamW(param_groups(model, WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS)
    config = {**deepspeed_keys(args), "tensor_parallel": {"autotp_size": TP}}
    # DeepSpeed checks the batch sizes before it builds the TP groups, against all 2 ranks as data parallel
    # (1 != 1 x 1 x 2): let it derive train_batch_size instead.
    del config["train_batch_size"]
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    model.train()

    def train_step(x, y):
        loss = engine(input_ids=x, labels=y, shift_labels=y).loss  # labels already shifted
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    return engine, train_step, lambda x, y: engine.module(input_ids=x, labels=y, shift_labels=y).loss


def batches(args, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same (ids, labels) on every rank (AutoTP checks that the TP ranks see the same data)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def saved_bytes(variant: Variant, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes saved for backward by one forward (loss included): unique storages, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in variant.engine.module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = variant.forward_loss(x, y)
    del loss
    return sum(seen.values())


def proc_status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def timed_step(variant: Variant, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, loss) of one training step; times are the slowest rank's.  The CPU time is
    what the process itself ran: on a shared machine it is far less disturbed by other processes than the wall
    time, but it leaves out the time spent waiting for the other rank in collectives."""
    import torch.distributed as dist

    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    loss = variant.train_step(x, y)
    t = torch.tensor([time.perf_counter() - wall, time.process_time() - cpu], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1]), loss


def timed_rounds(variants: dict, data: list, warmup: int) -> dict:
    """One step of every variant per batch of ``data``, in an order that rotates every round (so no variant always
    runs first or last); wall and CPU seconds per timed step (after ``warmup`` rounds) and every step's loss."""
    names = list(variants)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    for step, (x, y) in enumerate(data):
        order = names[step % len(names) :] + names[: step % len(names)]
        for name in order:
            seconds, cpu_seconds, loss = timed_step(variants[name], x, y)
            losses[name].append(loss)
            if step >= warmup:
                wall[name].append(seconds)
                cpu[name].append(cpu_seconds)
        if int(os.environ["RANK"]) == 0 and step >= warmup:
            print(f"step {step}: " + " ".join(f"{n} {wall[n][-1] * 1e3:.0f}/{cpu[n][-1] * 1e3:.0f}" for n in names))
    return {"wall": wall, "cpu": cpu, "losses": losses}


def work_times(args) -> dict:
    """All variants in one process, timed in rotating rounds."""
    variants = {name: Variant(name, args) for name in VARIANTS}
    return timed_rounds(variants, batches(args, args.warmup + args.steps), args.warmup)


def work_memory(args) -> dict:
    """One variant alone: RSS after the build, the peak while training, and the bytes one forward saves."""
    variant = Variant(args.variant, args)
    data = batches(args, 2)  # Adam's moments appear in the first step; the second confirms the peak
    rss_built = proc_status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    for x, y in data:
        variant.train_step(x, y)
    peak = proc_status_kb("VmHWM")
    x, y = data[0]
    return {"rss_built_kb": rss_built, "peak_rss_kb": peak, "saved_bytes": saved_bytes(variant, x, y)}


def worker(args) -> None:
    from ds_megatron.engine import init_distributed

    # Through ds_megatron, whichever variant comes first: it unlinks the /dev/shm buffer DeepSpeed's CPU all-reduce
    # leaves behind (~66 MB per rank and launch), which deepspeed.initialize alone would leak.
    init_distributed()
    result = work_times(args) if args.work == "times" else work_memory(args)
    Path(args.out, f"{args.work}-{args.variant}.rank{os.environ['RANK']}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------
# Driver side.


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, work: str, variant: str, out: Path) -> list[dict]:
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(TP), "--master_port", str(_port())]
    cmd += [__file__, "--worker", "--work", work, "--variant", variant, "--out", str(out)]
    for key in ("layers", "hidden", "heads", "kv_heads", "ffn", "seq", "batch", "vocab", "warmup", "steps"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{work} {variant} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith("step "):
            print(line, flush=True)
    print(f"{work} {variant}: {time.perf_counter() - start:.0f} s", flush=True)
    return [json.loads((out / f"{work}-{variant}.rank{r}.json").read_text()) for r in range(TP)]


def num_params(args) -> int:
    """Embedding and untied output layer, then per layer q, k, v, o, gate, up, down and two RMSNorms; final norm."""
    h, d = args.hidden, args.hidden // args.heads
    per_layer = h * (args.heads + 2 * args.kv_heads) * d + args.heads * d * h + 3 * h * args.ffn + 2 * h
    return 2 * args.vocab * h + args.layers * per_layer + h


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def verdict(low: float, high: float, goal: str) -> str:
    """Whether the interquartile range of a ratio lies on the goal's side of 1 (goal ">= 1" or "< 1")."""
    if goal.startswith(">"):
        return "holds" if low >= 1 else "does not hold" if high < 1 else "unresolved (IQR spans 1)"
    return "holds" if high < 1 else "does not hold" if low >= 1 else "unresolved (IQR spans 1)"


def table(args, times: dict, memory: dict) -> str:
    tokens = args.batch * args.seq
    wall, cpu = times["wall"], times["cpu"]
    med = {n: statistics.median(v) for n, v in wall.items()}
    saved = {n: max(r["saved_bytes"] for r in memory[n]) for n in VARIANTS}
    lines = [
        "| variant | tokens/s | ms/step: median (min) | CPU ms/step | peak RSS per rank (MB) | RSS growth while "
        "training (MB) | saved for backward per rank, one micro-batch (MB) | loss, last step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        ranks = memory[name]
        peak = max(r["peak_rss_kb"] for r in ranks) / 1024
        growth = max(r["peak_rss_kb"] - r["rss_built_kb"] for r in ranks) / 1024
        lines.append(
            f"| {LABELS[name]} | {tokens / med[name]:,.0f} | {med[name] * 1e3:,.0f} ({min(wall[name]) * 1e3:,.0f}) "
            f"| {statistics.median(cpu[name]) * 1e3:,.0f} | {peak:,.0f} | {growth:,.0f} | "
            f"{saved[name] / 2**20:.1f} | {times['losses'][name][-1]:.4f} |"
        )
    checks = [  # (label, first, second, goal) for speed; the saved-bytes check is one number
        ("ds_megatron none vs AutoTP none", "dsm-none", "autotp-none", ">= 1"),
        ("ds_megatron full vs AutoTP full", "dsm-full", "autotp-full", ">= 1"),
        ("ds_megatron SP + selective vs AutoTP full", "dsm-selective", "autotp-full", "> 1"),
    ]
    lines += [
        "",
        "Speed ratios (> 1: the first is faster), per round (one step of every variant on the same tokens): median "
        "and interquartile range.  An acceptance holds by a measure when the whole IQR lies on the goal's side of 1.",
        "",
        "| comparison | wall time: median (IQR) | CPU time: median (IQR) | min wall ratio | goal | by wall | by CPU |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, a, b, goal in checks:
        w1, w2, w3 = quartiles([tb / ta for ta, tb in zip(wall[a], wall[b])])
        c1, c2, c3 = quartiles([tb / ta for ta, tb in zip(cpu[a], cpu[b])])
        lines.append(
            f"| {label} | **{w2:.2f}** ({w1:.2f}-{w3:.2f}) | **{c2:.2f}** ({c1:.2f}-{c3:.2f}) | "
            f"{min(wall[b]) / min(wall[a]):.2f} | {goal} | {verdict(w1, w3, goal)} | {verdict(c1, c3, goal)} |"
        )
    ratio = saved["dsm-selective"] / saved["autotp-none"]
    lines += [
        "",
        f"Saved for backward, ds_megatron SP + selective / AutoTP none: **{ratio:.2f}** (goal < 1: "
        f"{'holds' if ratio < 1 else 'does not hold'}).",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=704, help="SwiGLU width (intermediate_size)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1, help="micro-batch (also the global batch: dp 1)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16, help="timed steps per variant")
    ap.add_argument("--markdown")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", choices=("times", "memory"), help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="all", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(tempfile.mkdtemp(prefix="vs_autotp_"))
    load_start = os.getloadavg()[0]
    times = launch(args, "times", "all", out)[0]
    memory = {name: launch(args, "memory", name, out) for name in VARIANTS}
    load = f"load average (1 min) {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    body = (
        f"Llama, {args.layers} layers, h {args.hidden}, {args.heads} heads ({args.kv_heads} KV heads, head dim "
        f"{args.hidden // args.heads}), SwiGLU width {args.ffn}, V {args.vocab} (untied), s {args.seq}, "
        f"micro-batch {args.batch}; tp {TP} on {TP} CPU processes (gloo, OMP_NUM_THREADS=1), bf16 + ZeRO-1, AdamW, "
        f"clipping 1.0, eager attention, no dropout; {args.steps} timed steps per variant after {args.warmup} "
        f"warm-up, interleaved in one launch (wall and CPU time per step: the slowest rank's); memory from one "
        f"launch per variant (RSS: /proc VmHWM, reset after the build; saved bytes: unique storages saved for "
        f"backward by one forward with the loss, parameters excluded); {load} on {os.cpu_count()} cores.  "
        f"{num_params(args) / 1e6:.1f}M parameters: at 16 bytes each (bf16 weight and gradient, fp32 master and Adam "
        f"moments) the model states come to {num_params(args) * 16 / 2**20:.0f} MB in all (less per rank once TP "
        f"splits them), so with s / h = {args.seq // args.hidden} the activations (the s^2 attention terms above "
        f"all) dominate.\n\n{table(args, times, memory)}"
    )
    print(body)
    if args.markdown:
        write_markdown(
            args.markdown,
            "Llama at tp 2: ds_megatron against DeepSpeed AutoTP",
            "python benchmarks/throughput_vs_autotp.py",
            body,
        )


if __name__ == "__main__":
    main()
