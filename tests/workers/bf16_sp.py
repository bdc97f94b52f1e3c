"""bf16 + ZeRO-1 (DeepSpeed's BF16 optimizer) with SP at tp 2 and 4 micro-batches per step: the path GPUs use.
Writes per rank the losses, the gradient norm and this rank's LayerNorm/bias weights (bf16 model copies) after 5
steps, with the SP-replicated gradients summed once per step (default) or per micro-batch (--sp-grad-sync); a
comma-separated list (``step,micro_batch``) trains one engine per mode, one after the other in this launch (each
build seeds every generator from the config's seed, so the runs draw the same data and dropout masks)."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from common import micro_batches, tiny_ds_config, token_batches, write_result  # noqa: E402

from ds_megatron.config import resolve  # noqa: E402
from ds_megatron.engine import build_engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--sp-grad-sync", default="step", help="step, micro_batch or a comma-separated list")
    args = ap.parse_args()
    for mode in args.sp_grad_sync.split(","):
        if mode not in ("step", "micro_batch"):
            ap.error(f"--sp-grad-sync: {mode!r} is not step or micro_batch")
        train(args.out, mode)


def train(out: str, sp_grad_sync: str) -> None:
    cfg = tiny_ds_config(
        2,
        1,
        1,
        sequence_parallel=True,
        dropout=0.1,
        extra={
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 1},
            "zero_allow_untested_optimizer": True,
            "data_types": {"grad_accum_dtype": "fp32"},
        },
    )
    cfg["ds_megatron"]["parallel"]["sp_grad_sync"] = sp_grad_sync
    run = resolve(cfg, int(os.environ["WORLD_SIZE"]))
    built = build_engine(run)
    engine = built.engine
    losses, norms = [], []
    for tokens in token_batches(5, run.global_batch_size, run.model.seq_length, run.model.vocab_size):
        losses.append(float(engine.train_batch(iter(micro_batches(tokens, run.micro_batch_size, 1, 0)))))
        norms.append(float(engine.get_global_grad_norm()))
    replicated = {
        name: p.detach().float().flatten().tolist()
        for name, p in engine.module.named_parameters()
        if getattr(p, "sequence_parallel_replicated", False)
    }
    write_result(
        out,
        f"bf16-sp-{sp_grad_sync}",
        {"losses": losses, "norms": norms, "replicated": replicated, "tp_rank": built.topology.tp_rank},
    )


if __name__ == "__main__":
    main()
