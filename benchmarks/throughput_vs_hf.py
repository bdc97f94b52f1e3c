"""Training throughput of ds_megatron (tp 1, pp 1, through its pipeline engine) against transformers'
GPT2LMHeadModel under ``deepspeed.initialize``: same shape, batch, dtype (fp32) and attention kernel, steps
interleaved (ds_megatron, transformers, ds_megatron, ...) in one process so machine noise hits both alike.

    python benchmarks/throughput_vs_hf.py [--layers 4 --hidden 256 --heads 8 --seq 256 --batch 4 --vocab 8192]
                                          [--reps 8] [--markdown OUT.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ds_megatron.checkpoint.adapter import StateDictAdapter  # noqa: E402
from ds_megatron.config import resolve  # noqa: E402
from ds_megatron.engine import build_engine  # noqa: E402
from ds_megatron.model.gpt2.model import GPT, GPTConfig  # noqa: E402


def ds_config(args, kernel: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
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
        },
    }


def build_hf(run, seed: int):
    """transformers' GPT-2 with exactly ds_megatron's initial weights, under a plain DeepSpeed engine."""
    cfg = GPTConfig.from_shape(run.model)
    model = GPT2LMHeadModel(cfg.to_hf())
    model.load_state_dict(StateDictAdapter.of(cfg).to_hf_state_dict(GPT(cfg, seed=seed).state_dict()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=opt,
        config={
            "train_micro_batch_size_per_gpu": run.micro_batch_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "steps_per_print": 10**9,
        },
    )
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--markdown")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for kernel in ("eager", "sdpa"):
        run = resolve(ds_config(args, kernel), 1)
        ours = build_engine(run).engine
        hf = build_hf(run, run.section.train.seed)
        hf.module.config._attn_implementation = kernel
        times = {"ds_megatron": [], "transformers": []}
        for rep in range(args.reps + 1):
            tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
            x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
            start = time.perf_counter()
            ours.train_batch(iter([(x, y)]))
            t_ours = time.perf_counter() - start
            start = time.perf_counter()
            loss = hf(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
            hf.backward(loss)
            hf.step()
            t_hf = time.perf_counter() - start
            if rep > 0:  # the first round warms up
                times["ds_megatron"].append(t_ours)
                times["transformers"].append(t_hf)
        med = {k: statistics.median(v) for k, v in times.items()}
        tps = {k: args.batch * args.seq / v for k, v in med.items()}
        rows.append((kernel, tps["ds_megatron"], tps["transformers"], tps["ds_megatron"] / tps["transformers"]))
    lines = [
        f"Training throughput, {args.layers} layers, h={args.hidden} a={args.heads} s={args.seq} b={args.batch} "
        f"V={args.vocab}, fp32, dropout 0.1, {torch.get_num_threads()} threads, "
        f"median of {args.reps} interleaved steps.",
        "",
        "| attention | ds_megatron tokens/s | transformers GPT2LMHeadModel tokens/s | ratio |",
        "|---|---|---|---|",
    ]
    lines += [f"| {k} | {a:,.0f} | {b:,.0f} | **{r:.2f}** |" for k, a, b, r in rows]
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(
                f"# Throughput against transformers\n\n{datetime.date.today().isoformat()}, {platform.machine()} "
                f"({os.cpu_count()} cores), torch {torch.__version__}, "
                f"`python benchmarks/throughput_vs_hf.py`\n\n{table}\n"
            )


if __name__ == "__main__":
    main()
