"""bf16 + ZeRO-1 (DeepSpeed's BF16 optimizer) with SP at tp 2 and 4 micro-batches per step: the path GPUs use.
Writes per rank the losses, the gradient norm and this rank's LayerNorm/bias weights (bf16 model copies) after 5
steps, with the SP-replicated gradients summed once per step (default) or per micro-batch (--sp-grad-sync); a
comma-separated list (``step,micro_batch``) trains one engine per mode, one after the other in this launch (each
build seeds every generator from the config's seed, so the runs draw the same data and dropout masks).

``--dp-reduction`` then builds the same bf16 path at dp 2 (tp 1) and records, for one step, the dtype and size of
every all-reduce DeepSpeed runs over its data-parallel group: the gradient sum's dtype is what GPUs send over NCCL."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch.distributed as dist  # noqa: E402
from common import micro_batches, tiny_ds_config, token_batches, write_result  # noqa: E402

from ds_megatron.config import resolve  # noqa: E402
from ds_megatron.engine import build_engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--sp-grad-sync", default="step", help="step, micro_batch, a comma-separated list or none ('')")
    ap.add_argument("--dp-reduction", action="store_true", help="also record the dp 2 gradient all-reduce's dtype")
    args = ap.parse_args()
    for mode in filter(None, args.sp_grad_sync.split(",")):
        if mode not in ("step", "micro_batch"):
            ap.error(f"--sp-grad-sync: {mode!r} is not step or micro_batch")
        train(args.out, mode)
    if args.dp_reduction:
        dp_reduction(args.out)


BF16 = {
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 1},
    "zero_allow_untested_optimizer": True,
    "data_types": {"grad_accum_dtype": "fp32"},
}


def dp_reduction(out: str) -> None:
    """One bf16 step at tp 1 x pp 1 x dp 2; every all-reduce over DeepSpeed's data-parallel group recorded as
    (dtype, elements), with the number of parameter elements the rank holds."""
    cfg = tiny_ds_config(1, 1, 2, extra=BF16)
    run = resolve(cfg, int(os.environ["WORLD_SIZE"]))
    built = build_engine(run)
    engine = built.engine
    group, seen, all_reduce = engine.mpu.get_data_parallel_group(), [], dist.all_reduce

    def recording(*args, **kwargs):
        if kwargs.get("group") is group:
            tensor = kwargs["tensor"] if "tensor" in kwargs else args[0]
            seen.append((str(tensor.dtype).removeprefix("torch."), tensor.numel()))
        return all_reduce(*args, **kwargs)

    dist.all_reduce = recording
    try:
        (tokens,) = token_batches(1, run.global_batch_size, run.model.seq_length, run.model.vocab_size)
        dp_rank = built.topology.data_coord
        engine.train_batch(iter(micro_batches(tokens, run.micro_batch_size, run.dp, dp_rank)))
    finally:
        dist.all_reduce = all_reduce
    params = sum(p.numel() for p in engine.module.parameters())
    write_result(out, "bf16-dp-reduce", {"all_reduces": seen, "params": params, "dp": run.dp})


def train(out: str, sp_grad_sync: str) -> None:
    cfg = tiny_ds_config(
        2,
        1,
        1,
        sequence_parallel=True,
        dropout=0.1,
        extra=BF16,
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
