"""Count the tensor-parallel collectives of one training step (tp 2 x pp 2, SP, 4 micro-batches, recompute none).

Wraps torch.distributed's collectives, counts the calls made on this rank's TP group during the second
``train_batch`` (the first one warms up), and writes the counts and bytes per kind with the stage's layer count.
gloo has no reduce-scatter: ds_megatron's reduce-scatters show up there as all-reduces of the full tensor."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(__file__))

import torch.distributed as dist  # noqa: E402
from common import micro_batches, tiny_ds_config, token_batches, write_result  # noqa: E402

from ds_megatron.config import resolve  # noqa: E402
from ds_megatron.engine import build_engine  # noqa: E402
from ds_megatron.pipeline_parallel.module import BlockPipe  # noqa: E402

COUNTS, BYTES = Counter(), Counter()
STATE = {"group": None, "on": False}


def counting(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        group = kwargs.get("group")
        if STATE["on"] and group is not None and group is STATE["group"]:
            tensor = args[0] if name != "all_gather" else args[1]
            COUNTS[name] += 1
            BYTES[name] += tensor.numel() * tensor.element_size()
        return fn(*args, **kwargs)

    return wrapper


for _name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor"):
    setattr(dist, _name, counting(_name, getattr(dist, _name)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    cfg = tiny_ds_config(2, 2, 1, sequence_parallel=True, dropout=0.1)
    run = resolve(cfg, int(os.environ["WORLD_SIZE"]))
    built = build_engine(run)
    STATE["group"] = built.topology.tp_group
    batches = token_batches(2, run.global_batch_size, run.model.seq_length, run.model.vocab_size)
    for i, tokens in enumerate(batches):
        STATE["on"] = i == 1
        built.engine.train_batch(iter(micro_batches(tokens, run.micro_batch_size, 1, 0)))
    STATE["on"] = False
    blocks = sum(isinstance(f, BlockPipe) for f in built.engine.module.forward_funcs)
    write_result(
        args.out,
        "collectives",
        {
            "counts": dict(COUNTS),
            "bytes": dict(BYTES),
            "pp_rank": built.topology.pp_rank,
            "blocks": blocks,
            "micro_batches": run.grad_accum_steps,
        },
    )


if __name__ == "__main__":
    main()
