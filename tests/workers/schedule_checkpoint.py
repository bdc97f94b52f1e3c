"""Checks run inside the parity worker's 2-process launch (its ``checkpoint`` layout), to save a launch:
checkpoints across pipeline schedules, tp 1 x pp 2, fp32, dropout 0, gradient accumulation 4 (= 2 x pp).

A: DualPipeV trains 4 steps and saves after step 2 (``DIR/dv``); every rank also writes its parameters at step 2 by
   full name (``DIR/params.rank<r>.pt``, for the export check).
B: DualPipeV resumes A's step 2 (same layout, DeepSpeed's own load) and trains steps 3-4.
C: 1F1B resumes A's step 2 (another schedule: resharded on load), trains step 3, saves (``DIR/f1``), trains step 4.
D: DualPipeV resumes C's step 3 (resharded back) and trains step 4.
E: ZB-H1 resumes C's step 3 and F: ``dualpipev-zb`` resumes A's step 2 (each schedule places the stages as the
   saved one did: DeepSpeed's own load, no resharding) and train on (E step 4, F step 3).
Before A, greedy decoding through the DualPipeV engine at the initial weights; after D, 2 steps of bf16 + ZeRO-1
under each schedule.
Writes DIR/losses.rank<r>.json: each run's losses by step, whether the load resharded, the decoded tokens.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from common import micro_batches, tiny_ds_config, token_batches, write_result

from ds_megatron.checkpoint.manifest import tag_config
from ds_megatron.checkpoint.run_state import load_run, save_run, tag_for
from ds_megatron.config import resolve
from ds_megatron.config.facts import needs_resharding
from ds_megatron.engine import build_engine
from ds_megatron.generate import Decoder
from ds_megatron.model.gpt2.model import GPT, GPTConfig
from ds_megatron.pipeline_parallel.module import pipeline_param_name
from ds_megatron.pipeline_parallel.schedules import schedule_of

BF16 = {
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 1},
    "zero_allow_untested_optimizer": True,
    "data_types": {"grad_accum_dtype": "fp32"},
}


def config(schedule: str):
    cfg = tiny_ds_config(1, 2, 1)
    cfg["ds_megatron"]["parallel"]["pipeline_schedule"] = schedule
    return resolve(cfg, int(os.environ["WORLD_SIZE"]))


def run_checks(out: str) -> None:
    """Every check above, writing into ``out`` (created)."""
    os.makedirs(out, exist_ok=True)
    run = config("dualpipev")
    batches = token_batches(4, run.global_batch_size, run.model.seq_length, run.model.vocab_size)

    def train(built, steps, save_at=None, save_dir=None) -> dict[int, float]:
        losses = {}
        for step in steps:
            it = iter(micro_batches(batches[step - 1], run.micro_batch_size, 1, 0))
            losses[step] = float(built.engine.train_batch(it))
            if step == save_at:
                client = {"step": step, "config": built.run.ds_config}
                save_run(built.engine, save_dir, step, client, built.rng, topology=built.topology)
        return losses

    def resume(schedule: str, load_dir: str, step: int):
        built = build_engine(config(schedule))
        tag = tag_for(step)
        load_run(built.engine, load_dir, built.rng, built.parallel, built.topology, built.run.ds_config, tag)
        return built, needs_resharding(tag_config(Path(load_dir), tag), built.run.ds_config)

    dv, f1 = os.path.join(out, "dv"), os.path.join(out, "f1")
    a = build_engine(run)
    # Greedy decoding through DualPipeV (logits on rank 0, 2p micro-batches per forward) equals the single-device
    # model's at the initial weights.
    decoder = Decoder(a.engine, a.topology, run.model.seq_length, run.micro_batch_size, 0, run.model.vocab_size)
    decoder = dataclasses.replace(decoder, schedule=schedule_of(run))
    prompt = [5, 17, 99, 3, 250]
    got = decoder.greedy(prompt, 6)
    model = GPT(GPTConfig.from_shape(run.model), seed=run.section.train.seed).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    result = {"A": train(a, [1, 2])}
    save_run(a.engine, dv, 2, {"step": 2, "config": a.run.ds_config}, a.rng, topology=a.topology)
    params = {
        pipeline_param_name(n, a.engine.module): p.detach().clone() for n, p in a.engine.module.named_parameters()
    }
    torch.save(params, os.path.join(out, f"params.rank{os.environ['RANK']}.pt"))
    result["A"].update(train(a, [3, 4]))
    b, result["B_resharded"] = resume("dualpipev", dv, 2)
    result["B"] = train(b, [3, 4])
    c, result["C_resharded"] = resume("1f1b", dv, 2)
    result["C"] = train(c, [3, 4], save_at=3, save_dir=f1)
    d, result["D_resharded"] = resume("dualpipev", f1, 3)
    result["D"] = train(d, [4])
    e, result["E_resharded"] = resume("zb-h1", f1, 3)
    result["E"] = train(e, [4])
    f, result["F_resharded"] = resume("dualpipev-zb", dv, 2)
    result["F"] = train(f, [3])
    result["generate"] = {"pipeline": got, "reference": ids[len(prompt) :]}
    # bf16 + ZeRO-1 (DeepSpeed's BF16 optimizer: fp32 masters, gradients accumulated in fp32 copies): each schedule.
    for schedule in ("1f1b", "dualpipev", "dualpipev-zb"):
        cfg = tiny_ds_config(1, 2, 1, extra=BF16)
        cfg["ds_megatron"]["parallel"]["pipeline_schedule"] = schedule
        built = build_engine(resolve(cfg, int(os.environ["WORLD_SIZE"])))
        losses = train(built, [1, 2])
        result[f"bf16-{schedule}"] = {"losses": losses, "norm": float(built.engine.get_global_grad_norm())}
    write_result(out, "losses", result)
