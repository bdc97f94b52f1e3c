"""Checks run inside the parity worker's 2-process launch (its ``interleaved-checkpoint`` layout): checkpoints,
export and sampling under interleaved 1F1B, tp 1 x pp 2, v 2, fp32, dropout 0, gradient accumulation 4, 8 layers
(so that v 4's 8 stages hold a block each).

A: interleaved-1f1b trains 4 steps and saves after step 2 (``DIR/il``), and writes the weights each rank holds then
   by full name (``DIR/params.rank<r>.pt``: the export check's single-device model is built from them).
B: interleaved-1f1b resumes A's step 2 (same placement: DeepSpeed's own load) and trains steps 3-4.
C: 1F1B resumes A's step 2 (stages r, r + p -> stage r: resharded on load), trains step 3, saves (``DIR/f1``).
D: interleaved-1f1b resumes C's step 3 (resharded back) and trains step 4; E: interleaved-zb resumes A's step 2
   (the same placement, no resharding) and trains step 3.
F: interleaved-1f1b at the uneven pipeline_layout [0, 3, 5, 0] (the embedding alone on stage 0, the output layer
   alone on stage 3) resumes A's step 2 (another split: resharded on load), trains steps 3-4 and saves after step
   3 (``DIR/uneven``, with each rank's weights by full name in ``DIR/params-uneven.rank<r>.pt``, for export).
G: 1F1B at the uneven layout [3, 5] resumes C's step 3 (even, resharded) and trains step 4.
H: interleaved-1f1b at v 4 resumes A's step 2 (stages r, r + 2 -> r, r + 2, r + 4, r + 6: resharded on load) and
   trains steps 3-4.
Before A, greedy decoding through the interleaved engine (logits on rank p - 1, the order's forward-only step) at
the initial weights, against the single-device model.
Writes DIR/losses.rank<r>.json: each run's losses by step, whether the load resharded, the decoded tokens, and F's
and H's pipeline-layer bounds per chunk.
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


def config(schedule: str, layout: list[int] | None = None, v: int = 2):
    cfg = tiny_ds_config(1, 2, 1, layers=8)
    cfg["ds_megatron"]["parallel"]["pipeline_schedule"] = schedule
    if schedule.startswith("interleaved"):
        cfg["ds_megatron"]["parallel"]["virtual_stages"] = v
    if layout is not None:
        cfg["ds_megatron"]["parallel"]["pipeline_layout"] = layout
    return resolve(cfg, int(os.environ["WORLD_SIZE"]))


def run_checks(out: str) -> None:
    """Every check above, writing into ``out`` (created)."""
    os.makedirs(out, exist_ok=True)
    run = config("interleaved-1f1b")
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

    def resume(schedule: str, load_dir: str, step: int, layout: list[int] | None = None, v: int = 2):
        built = build_engine(config(schedule, layout, v))
        tag = tag_for(step)
        load_run(built.engine, load_dir, built.rng, built.parallel, built.topology, built.run.ds_config, tag)
        return built, needs_resharding(tag_config(Path(load_dir), tag), built.run.ds_config)

    il, f1 = os.path.join(out, "il"), os.path.join(out, "f1")
    a = build_engine(run)
    decoder = Decoder(a.engine, a.topology, run.model.seq_length, run.micro_batch_size, 0, run.model.vocab_size)
    decoder = dataclasses.replace(decoder, schedule=schedule_of(run))
    prompt = [5, 17, 99, 3, 250]
    got = decoder.greedy(prompt, 6)
    model = GPT(GPTConfig.from_shape(run.model), seed=run.section.train.seed).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    result = {"A": train(a, [1, 2], save_at=2, save_dir=il)}
    held = {pipeline_param_name(n, a.engine.module): p.detach().clone() for n, p in a.engine.module.named_parameters()}
    torch.save(held, os.path.join(out, f"params.rank{os.environ['RANK']}.pt"))
    result["A"].update(train(a, [3, 4]))
    b, result["B_resharded"] = resume("interleaved-1f1b", il, 2)
    result["B"] = train(b, [3, 4])
    c, result["C_resharded"] = resume("1f1b", il, 2)
    result["C"] = train(c, [3], save_at=3, save_dir=f1)
    d, result["D_resharded"] = resume("interleaved-1f1b", f1, 3)
    result["D"] = train(d, [4])
    e, result["E_resharded"] = resume("interleaved-zb", il, 2)
    result["E"] = train(e, [3])
    f, result["F_resharded"] = resume("interleaved-1f1b", il, 2, [0, 3, 5, 0])
    result["F"] = train(f, [3], save_at=3, save_dir=os.path.join(out, "uneven"))
    rank = f.topology.pp_rank
    params = {
        pipeline_param_name(n, f.engine.module): p.detach().clone() for n, p in f.engine.module.named_parameters()
    }
    torch.save(params, os.path.join(out, f"params-uneven.rank{rank}.pt"))
    result["F"].update(train(f, [4]))
    result["F_layers"] = [[int(a), int(b)] for a, b in f.engine.module.chunk_bounds]
    g, result["G_resharded"] = resume("1f1b", f1, 3, [3, 5])
    result["G"] = train(g, [4])
    h, result["H_resharded"] = resume("interleaved-1f1b", il, 2, v=4)
    result["H"] = train(h, [3, 4])
    result["H_layers"] = [[int(i) for i in bounds] for bounds in h.engine.module.chunk_bounds]
    result["generate"] = {"pipeline": got, "reference": ids[len(prompt) :]}
    write_result(out, "losses", result)
