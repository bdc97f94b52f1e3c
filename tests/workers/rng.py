"""RNG worker (world 4, tp 2, dp 2, dropout on): records which elements each dropout of block 0 zeroed in the first
micro-batch and writes, from rank 0, whether masks match across TP ranks and across DP ranks."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import micro_batches, tiny_ds_config, token_batches  # noqa: E402

from ds_megatron.config import resolve  # noqa: E402
from ds_megatron.engine import build_engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sequence-parallel", action="store_true", help="SP on (rng.json)")
    ap.add_argument("--both", action="store_true", help="SP off (rng.json), then on (rng-sp.json), in this launch")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    for sp in (False, True) if args.both else (args.sequence_parallel,):
        record(Path(args.out, "rng-sp.json" if args.both and sp else "rng.json"), sp)


def record(path: Path, sequence_parallel: bool) -> None:
    cfg = tiny_ds_config(2, 1, 2, dropout=0.3, sequence_parallel=sequence_parallel)
    cfg["ds_megatron"]["train"]["seed"] = 7
    run = resolve(cfg, int(os.environ["WORLD_SIZE"]))
    built = build_engine(run)
    engine, topo = built.engine, built.topology
    block = engine.module.get_submodule("2").block  # transformer block 0
    targets = {
        "embedding_dropout": engine.module.get_submodule("1").drop,
        "residual_dropout": block.attn.resid_dropout,
        "mlp_dropout": block.mlp.dropout,
        "attention_probs_dropout": block.attn.core_attention.attn_dropout,
    }
    masks: dict[str, torch.Tensor] = {}

    def hook(name):
        def fn(module, inputs, output):
            if name not in masks:  # first micro-batch only
                masks[name] = ((output == 0) & (inputs[0] != 0)).flatten()

        return fn

    for name, mod in targets.items():
        mod.register_forward_hook(hook(name))
    tokens = token_batches(1, run.global_batch_size, run.model.seq_length, run.model.vocab_size)[0]
    # Same data on every DP rank, so mask differences across DP come from the RNG alone.
    engine.train_batch(iter(micro_batches(tokens, run.micro_batch_size, 1, 0)[: run.grad_accum_steps]))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"coord": (topo.tp_rank, topo.dp_rank), "masks": masks})
    if dist.get_rank() == 0:
        by = {tuple(g["coord"]): g["masks"] for g in gathered}
        result = {}
        for name in targets:
            m00, m10, m01 = by[(0, 0)][name], by[(1, 0)][name], by[(0, 1)][name]
            same_shape = m00.shape == m10.shape
            result[name] = {
                "dropped_fraction": float(m00.float().mean()),
                "same_across_tp": bool(same_shape and torch.equal(m00, m10)),
                "same_across_dp": bool(torch.equal(m00, m01)),
            }
        path.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
