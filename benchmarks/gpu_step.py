"""One-GPU step benchmark behind benchmarks/gpu_check.sh (also runs on CPU with --tiny, as a smoke test).

    deepspeed --num_gpus 1 benchmarks/gpu_step.py [--layers 8] [--micro-batch 2] [--markdown OUT.md] [--tiny]
    python benchmarks/gpu_step.py --config sdpa:full --rows ROWS.jsonl      (one configuration per process)
    python benchmarks/gpu_step.py --rows ROWS.jsonl --markdown OUT.md      (the table of those processes' results)

A GPT-3 1.3B-shaped model (h 2048, 16 heads, s 2048, V 50257; fewer layers than 24 to fit the time) in bf16 with
ZeRO-1 and fp32 gradient accumulation, trained through the real ds_megatron pipeline engine for each attention
kernel with recompute none, selective (eager: the core attention; sdpa: the MLP activation and the LayerNorm outputs,
the modules that compose with it) and full.  Per configuration: median step time of the measured steps (warm-up
dropped), tokens/s, MFU and HFU against the device's peak, peak memory (``max_memory_allocated``), the growth of
memory during a step (activations and workspace) and the analytic activation prediction for the transformer layers.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ds_megatron.config import ConfigError, resolve  # noqa: E402
from ds_megatron.data import MicroBatchStream, PackedSamples  # noqa: E402
from ds_megatron.engine import build_engine  # noqa: E402
from ds_megatron.flops import executed_flops_per_step, model_flops_per_step  # noqa: E402
from ds_megatron.memory import activation_bytes_per_layer  # noqa: E402
from ds_megatron.metrics import lookup_peak_tflops  # noqa: E402

# (attention kernel, recompute policy, selective recompute modules)
CONFIGS = (
    ("eager", "none", ()),
    ("eager", "selective", ("core_attn",)),
    ("eager", "full", ()),
    ("sdpa", "none", ()),
    ("sdpa", "selective", ("mlp_act", "layernorm")),
    ("sdpa", "full", ()),
)


def peak_tflops(override: float | None) -> float | None:
    if override:
        return override
    if not torch.cuda.is_available():
        return None
    return lookup_peak_tflops(torch.cuda.get_device_name())


def ds_config(args, policy: str, kernel: str, modules: tuple = ()) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "data_types": {"grad_accum_dtype": "fp32"},
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "ds_megatron": {
            "model": {
                "num_layers": args.layers,
                "hidden_size": args.hidden,
                "num_heads": args.heads,
                "vocab_size": args.vocab,
                "seq_length": args.seq,
                "dropout": 0.1,
                "attention": kernel,
            },
            "recompute": {"policy": policy, "num_layers": 1, "method": "uniform"}
            | ({"modules": list(modules)} if modules else {}),
        },
    }


def measure(args, policy: str, kernel: str, modules: tuple, peak: float | None) -> dict:
    try:
        run = resolve(ds_config(args, policy, kernel, modules), 1)
    except ConfigError as err:
        return {"refused": str(err).split(":", 2)[-1].split(";")[0].strip()}
    built = build_engine(run)
    engine = built.engine
    cuda = torch.cuda.is_available()
    tokens = torch.randint(0, args.vocab, (args.seq * 64,), generator=torch.Generator().manual_seed(0))
    stream = MicroBatchStream(PackedSamples(tokens, args.seq, seed=0), args.micro_batch, 1, 0, 1)
    times, base = [], 0
    for i in range(args.warmup + args.steps):
        if i == args.warmup and cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.train_batch(stream)
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    step = statistics.median(times)
    b, s, h, a, n, v = args.micro_batch, args.seq, args.hidden, args.heads, args.layers, args.vocab
    model_flops = model_flops_per_step(b, s, n, h, v)
    hw_flops = executed_flops_per_step(b, s, n, h, v, policy, recompute_modules=modules)
    result = {
        "step_ms": 1000 * step,
        "tokens_s": b * s / step,
        "mfu": model_flops / step / (peak * 1e12) if peak else None,
        "hfu": hw_flops / step / (peak * 1e12) if peak else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "step_growth_gib": (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None,
        # GPU dropout masks are 1 byte; CUDA's sdpa takes a fused kernel (dropout included), which keeps the
        # log-sum-exp instead of the s x s terms.
        "predicted_act_gib": n
        * activation_bytes_per_layer(s, b, h, a, recompute=policy, attention=kernel, sdpa_path="fused", modules=modules)
        / 2**30,
    }
    del engine, built
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def fmt(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def label(policy: str, modules: tuple) -> str:
    return f"{policy}[{','.join(modules)}]" if modules and modules != ("core_attn",) else policy


def config_name(kernel: str, policy: str) -> str:
    """The name ``--config`` takes (kernel:policy), one per CONFIGS entry."""
    return f"{kernel}:{policy}"


def table_row(kernel: str, policy: str, modules: tuple, r: dict | None) -> str:
    if r is None:
        return (
            f"| {kernel} | {label(policy, modules)} | no result: the run failed or ran out of time (see its log) |"
            + (" |" * 6)
        )
    if "refused" in r:
        return f"| {kernel} | {label(policy, modules)} | refused: {r['refused']} | | | | | | |"
    return (
        f"| {kernel} | {label(policy, modules)} | {r['step_ms']:.1f} | {r['tokens_s']:,.0f} | {fmt(r['mfu'], '.1%')} | "
        f"{fmt(r['hfu'], '.1%')} | {fmt(r['peak_gib'], '.2f')} | {fmt(r['step_growth_gib'], '.2f')} | "
        f"{r['predicted_act_gib']:.2f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, help="device peak (bf16 dense); known GPUs are looked up")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: a tiny shape, one measured step")
    names = [config_name(kernel, policy) for kernel, policy, _ in CONFIGS]
    ap.add_argument("--config", choices=names, help="measure this configuration only and append it to --rows")
    ap.add_argument(
        "--rows",
        help="with --config: the JSON-lines file its result is appended to; alone: the "
        "file whose results make the table (a configuration without one is reported as failed)",
    )
    ap.add_argument("--markdown")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.heads, args.seq, args.vocab = 2, 64, 4, 32, 300
        args.micro_batch, args.warmup, args.steps = 2, 1, 1
    peak = peak_tflops(args.peak_tflops)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if args.config:  # one configuration in this process (gpu_check.sh: peak memory of one engine alone)
        kernel, policy, modules = CONFIGS[names.index(args.config)]
        r = measure(args, policy, kernel, modules, peak)
        if rank0 and args.rows:
            with open(args.rows, "a") as f:
                f.write(json.dumps({"config": args.config, "result": r, "device": device_name(), "peak": peak}) + "\n")
        return
    if args.rows:  # the table of the per-process results
        rows = [json.loads(line) for line in open(args.rows)] if os.path.exists(args.rows) else []
        results = {row["config"]: row["result"] for row in rows}
        device, peak = (rows[0]["device"], rows[0]["peak"]) if rows else ("unknown", None)
    else:
        results = {
            name: measure(args, policy, kernel, modules, peak)
            for name, (kernel, policy, modules) in zip(names, CONFIGS)
        }
        device = device_name()
    lines = [
        f"GPT-3 1.3B shape with {args.layers} layers: h={args.hidden} a={args.heads} s={args.seq} V={args.vocab} "
        f"b={args.micro_batch}, bf16, ZeRO-1, dropout 0.1; {device}, peak {fmt(peak, '.0f')} TFLOP/s; median of "
        f"{args.steps} steps after {args.warmup} warm-up.",
        "",
        "| attention | recompute | step (ms) | tokens/s | MFU | HFU | peak mem (GiB) | step growth (GiB) | "
        "predicted layer activations (GiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [table_row(k, p, m, results.get(name)) for name, (k, p, m) in zip(names, CONFIGS)]
    lines += [
        "",
        "Step growth = peak during the measured steps minus memory held between steps (weights, gradients, optimizer "
        "states); it includes the output layer and loss (about 10 s·b·V bytes: bf16 logits, fp32 copy and softmax) "
        "and kernel workspace, which the per-layer prediction leaves out.",
    ]
    table = "\n".join(lines)
    if rank0:
        print(table, flush=True)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(f"# GPU check\n\n{datetime.date.today().isoformat()}, `bash benchmarks/gpu_check.sh`\n\n")
                f.write(table + "\n")
    if len(results) < len(CONFIGS):
        raise SystemExit(1)


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
