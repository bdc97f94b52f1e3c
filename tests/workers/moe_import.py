"""MoE import worker: ``moe_import.py --out DIR --plan PLAN.json``, where PLAN lists cases ``{"name", "config"}``, each
a run config whose ``ds_megatron.checkpoint.load`` is a step-0 checkpoint written by ``python -m
ds_megatron.checkpoint import``.  Each case, one engine after the other in this launch: the tag verified against its
manifest and loaded as the trainer loads it (``run_state.load_run``: DeepSpeed's module-only load, or the by-name
reader at ep > 1 or another layout); the logits of the first micro-batch (data-parallel rank 0's, gathered over TP
on the last stage: [b, s, V]) through the pipeline's evaluation; then ``STEPS`` training steps on the tokens of
``common.token_batches``.  Rank 0 writes ``<name>.pt``: the tokens of every step, the logits, and per step every
rank's loss with the LM and load-balancing parts the engine averages over the micro-batches and the data axis."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import micro_batches, token_batches  # noqa: E402

from ds_megatron.checkpoint.run_state import load_run, verified_load_tag  # noqa: E402
from ds_megatron.config import resolve  # noqa: E402
from ds_megatron.engine import build_engine  # noqa: E402
from ds_megatron.tensor_parallel.mappings import gather_last_dim  # noqa: E402

STEPS = 2


def first_logits(engine, topo, batch: tuple[torch.Tensor, torch.Tensor], vocab: int) -> torch.Tensor | None:
    """Collective: the logits [b, s, V] of one micro-batch through the pipeline's evaluation, on the last stage's
    TP rank 0 of data-parallel rank 0 (None elsewhere)."""
    engine.total_loss = None  # eval_batch adds to a loss left by an earlier evaluation (generate.py does the same)
    with getattr(engine.module.loss_fn, "emitting_logits", contextlib.nullcontext)():
        _, logits = engine.eval_batch(
            iter([batch]), return_logits=True, compute_loss=False, reduce_output=None, num_micro_batches=1
        )
    engine.total_loss = None
    engine.module.train()
    if topo.pp_rank != topo.pp - 1:
        return None
    full = gather_last_dim(logits.float(), topo.tp_group)[..., :vocab]  # [s, b, V_pad] -> [s, b, V]
    return full.transpose(0, 1).contiguous() if topo.tp_rank == 0 and topo.data_coord == 0 else None


def gathered(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def run_case(name: str, cfg: dict, out: str) -> None:
    world = int(os.environ["WORLD_SIZE"])
    run = resolve(cfg, world)
    ck = run.section.checkpoint.load
    built = build_engine(run)
    tag = verified_load_tag(ck)  # every file against the manifest's sha256, as the trainer does before loading
    engine, topo = built.engine, built.topology
    client = load_run(engine, ck, built.rng, built.parallel, topo, run.ds_config, tag)
    steps = token_batches(STEPS, run.global_batch_size, run.model.seq_length, run.model.vocab_size)
    batches = [micro_batches(t, run.micro_batch_size, run.dp, topo.data_coord) for t in steps]
    logits = [x for x in gathered(first_logits(engine, topo, batches[0][0], run.model.vocab_size)) if x is not None]
    records = []
    for step in batches:
        loss = float(engine.train_batch(iter(step)))
        extra = {k: float(v) for k, v in (engine.agg_additional_losses or {}).items()}
        records.append(gathered({"loss": loss, "lm_loss": extra.get("lm_loss"), "aux_loss": extra.get("aux_loss")}))
    if dist.get_rank() == 0:
        result = {"tokens": steps, "logits": logits, "steps": records, "client_step": client.get("step")}
        result["ep"], result["layout"] = topo.ep, (topo.tp, topo.pp, topo.dp)
        torch.save(result, os.path.join(out, f"{name}.pt"))
    engine.destroy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    with open(args.plan) as f:
        for case in json.load(f):
            run_case(case["name"], case["config"], args.out)


if __name__ == "__main__":
    main()
