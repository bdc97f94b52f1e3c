"""Recompute worker: one training step per recompute policy with dropout on and the same seed; writes each policy's
loss and its largest gradient difference from the ``none`` run (every parameter of this rank).  ``--llama`` repeats
it for the Llama family (its attention dropout is its only dropout).  ``--variants tp,tp+sp`` runs both in one launch:
SP off for the GPT, then SP on for the GPT and the Llama."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from common import log, micro_batches, tiny_ds_config, token_batches, write_result  # noqa: E402

from ds_megatron.config import resolve  # noqa: E402
from ds_megatron.engine import build_engine  # noqa: E402

POLICIES = {
    "none": {"policy": "none"},
    "selective": {"policy": "selective"},
    "full-uniform-1": {"policy": "full", "method": "uniform", "num_layers": 1},
    "full-uniform-2": {"policy": "full", "method": "uniform", "num_layers": 2},
    "full-block-1": {"policy": "full", "method": "block", "num_layers": 1},
    "modules": {"policy": "selective", "modules": ["core_attn", "mlp_act", "layernorm"]},
}


LLAMA_FIELDS = {"family": "llama", "num_kv_heads": 2, "intermediate_size": 96, "rope_theta": 10000.0}


def one_step(policy: dict, args, llama: bool = False, sp: bool = False) -> tuple[float, dict]:
    cfg = tiny_ds_config(args.tp, args.pp, 1, dropout=0.1, sequence_parallel=sp)
    if llama:
        cfg["ds_megatron"]["model"].update(LLAMA_FIELDS)
    cfg["ds_megatron"]["recompute"] = policy
    run = resolve(cfg, int(os.environ["WORLD_SIZE"]))
    built = build_engine(run)
    engine = built.engine
    grads = {}

    def capture(optimizer, *_):
        for name, p in engine.module.named_parameters():
            grads[name] = p.grad.detach().clone()

    engine.optimizer.register_step_pre_hook(capture)
    tokens = token_batches(1, run.global_batch_size, run.model.seq_length, run.model.vocab_size)[0]
    loss = float(engine.train_batch(iter(micro_batches(tokens, run.micro_batch_size, 1, 0))))
    return loss, grads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--llama", action="store_true")
    ap.add_argument("--variants", help="tp (SP off, GPT) and/or tp+sp (SP on, GPT and Llama), comma-separated")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    if args.variants is None:
        runs = [(args.sequence_parallel, llama) for llama in ((False, True) if args.llama else (False,))]
    else:
        variants = {"tp": [(False, False)], "tp+sp": [(True, False), (True, True)]}
        runs = [run for v in args.variants.split(",") for run in variants[v]]
    for sp, llama in runs:
        result = {}
        for name, policy in POLICIES.items():  # "none" first: the run the others are compared with
            loss, grads = one_step(policy, args, llama, sp)
            if name == "none":
                base_loss, base_grads = loss, grads
            diff = max(float((grads[k] - base_grads[k]).abs().max()) for k in base_grads)
            result[name] = {"loss": loss, "base_loss": base_loss, "grad_diff": diff, "num_params": len(grads)}
        log(result)
        name = "recompute" + ("-sp" if sp else "") + ("-llama" if llama else "")
        write_result(args.out, name, result)


if __name__ == "__main__":
    main()
