"""Import worker: build the tp 2 x pp 2 SP pipeline from a transformers GPT-2 directory (--init-from-hf) and save a
step-0 checkpoint for the export round trip; with --hf-llama, the same for a LlamaForCausalLM directory (4 heads,
2 KV heads, untied) into ck_llama.

Then ``--load`` of the same GPT-2 written offline by ``python -m ds_megatron.checkpoint import`` (rank 0 imports,
the others wait): at the run's layout in fp32 (DeepSpeed's module-only load) and bf16 (the BF16 optimizer's fp32
masters must come from the loaded weights), and at tp 1 x pp 1 (resharded on load).  Each must hold the weights
--init-from-hf gave, at step 0, and the fp32 one trains a step from them."""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from common import micro_batches, tiny_ds_config, token_batches, write_result  # noqa: E402

from ds_megatron.checkpoint.import_cmd import import_checkpoint  # noqa: E402
from ds_megatron.checkpoint.run_state import load_run, save_run, verified_load_tag  # noqa: E402
from ds_megatron.config import resolve  # noqa: E402
from ds_megatron.engine import build_engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hf-llama")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    cfg = tiny_ds_config(2, 2, 1, vocab=1001, layers=3, sequence_parallel=True)
    cfg["ds_megatron"]["checkpoint"] = {"init_from_hf": args.hf}
    run = resolve(cfg, int(os.environ["WORLD_SIZE"]))
    built = build_engine(run)
    save_run(built.engine, os.path.join(args.out, "ck"), 0, {"step": 0, "config": run.ds_config}, built.rng)
    result = {"ok": True, "loads": _load_imported(args, cfg, built)}
    if args.hf_llama:
        cfg = tiny_ds_config(2, 2, 1, vocab=1001, layers=3, sequence_parallel=True)
        cfg["ds_megatron"]["model"].update(
            family="llama", num_kv_heads=2, intermediate_size=96, rope_theta=10000.0, tie_word_embeddings=False
        )
        cfg["ds_megatron"]["checkpoint"] = {"init_from_hf": args.hf_llama}
        run = resolve(cfg, int(os.environ["WORLD_SIZE"]))
        built = build_engine(run)
        save_run(built.engine, os.path.join(args.out, "ck_llama"), 0, {"step": 0, "config": run.ds_config}, built.rng)
    write_result(args.out, "import", result)


BF16 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}}


def _load_imported(args, cfg: dict, reference) -> dict:
    """Per variant: whether --load of the offline import holds the --init-from-hf weights (and, under bf16, fp32
    masters equal to them), its step, and (fp32) the loss and step counter after one training step."""
    world = int(os.environ["WORLD_SIZE"])
    want = {n: p.detach().clone() for n, p in reference.engine.module.named_parameters()}
    variants = {"fp32": (cfg, 2, 2), "bf16": ({**cfg, **BF16}, 2, 2), "resharded": (cfg, 1, 1)}
    out = {}
    for name, (run_cfg, tp, pp) in variants.items():
        ck = os.path.join(args.out, f"ck_import_{name}")
        if dist.get_rank() == 0:
            import_cfg = copy.deepcopy(run_cfg)
            import_cfg["ds_megatron"].pop("checkpoint")
            import_cfg["ds_megatron"]["parallel"]["sequence_parallel"] = tp > 1  # SP needs a TP group
            config_file = os.path.join(args.out, f"import_{name}.json")
            with open(config_file, "w") as f:
                json.dump(import_cfg, f)
            import_checkpoint(args.hf, ck, config_file, tp, pp, progress=False)
        dist.barrier()
        load_cfg = copy.deepcopy(run_cfg)
        load_cfg["ds_megatron"]["checkpoint"] = {"load": ck}
        run = resolve(load_cfg, world)
        tag = verified_load_tag(ck)  # every file against the manifest's sha256, as the trainer does first
        built = build_engine(run)
        client = load_run(built.engine, ck, built.rng, built.parallel, built.topology, run.ds_config, tag)
        params = dict(built.engine.module.named_parameters())
        same = all(torch.equal(p, want[n].to(p.dtype)) for n, p in params.items())
        record = {"step": client.get("step"), "same_weights": same, "global_steps": built.engine.global_steps}
        optimizer = built.engine.optimizer
        if name == "bf16":  # the fp32 masters are the loaded bf16 weights, not the engine's random init
            pairs = zip(optimizer.fp32_groups_flat_partition, optimizer.bf16_partitioned_groups)
            record["masters_from_weights"] = all(torch.equal(hp, lp[0].float()) for hp, lp in pairs)
        if name == "fp32":
            tokens = token_batches(1, run.global_batch_size, run.model.seq_length, run.model.vocab_size)[0]
            loss = float(built.engine.train_batch(iter(micro_batches(tokens, run.micro_batch_size, run.dp, 0))))
            record.update(loss_finite=math.isfinite(loss), steps_after=built.engine.global_steps)
        out[name] = record
    return out


if __name__ == "__main__":
    main()
