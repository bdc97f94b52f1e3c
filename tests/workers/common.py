"""Shared pieces of the multi-process test workers (run under the deepspeed launcher)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def tiny_ds_config(
    tp: int,
    pp: int,
    dp: int,
    *,
    vocab: int = 1001,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    seq: int = 16,
    micro: int = 2,
    global_batch: int = 8,
    dropout: float = 0.0,
    seed: int = 1234,
    attention: str = "eager",
    sequence_parallel: bool = False,
    cp: int = 1,
    cp_comm: str = "ring",
    lr: float = 1e-3,
    clip: float = 1.0,
    extra: dict | None = None,
) -> dict:
    cfg = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": global_batch // (micro * dp),
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "ds_megatron": {
            "model": {
                "num_layers": layers,
                "hidden_size": hidden,
                "num_heads": heads,
                "vocab_size": vocab,
                "seq_length": seq,
                "dropout": dropout,
                "attention": attention,
            },
            "parallel": {"tp": tp, "pp": pp, "sequence_parallel": sequence_parallel, "cp": cp, "cp_comm": cp_comm},
            "train": {"seed": seed, "train_iters": 3},
        },
    }
    for key, value in (extra or {}).items():
        cfg[key] = value
    return cfg


def token_batches(num_steps: int, global_batch: int, seq: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """Per step, [global_batch, seq + 1] random tokens (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (global_batch, seq + 1), generator=g) for _ in range(num_steps)]


def micro_batches(step_tokens: torch.Tensor, micro: int, dp: int, dp_rank: int, cp_rank: int = 0, cp: int = 1):
    """This DP rank's micro-batches of one step, as the pipeline engine wants them: (ids, labels); under context
    parallelism this CP rank's chunks of each (labels shifted over the whole sequence)."""
    from ds_megatron.context_parallel.layout import split_window

    gas = step_tokens.shape[0] // (micro * dp)
    mine = step_tokens.view(dp, gas, micro, -1)[dp_rank]
    return [tuple(t.contiguous() for t in split_window(mb, cp_rank, cp)) for mb in mine]


def write_result(out_dir: str, name: str, payload: dict) -> None:
    rank = int(os.environ.get("RANK", "0"))
    path = Path(out_dir) / f"{name}.rank{rank}.json"
    path.write_text(json.dumps(payload))


def log(*args) -> None:
    print(f"[rank {os.environ.get('RANK', '0')}]", *args, file=sys.stderr, flush=True)
