"""Parity worker: train the pipeline GPT at each (tp, pp, dp) layout for 3 steps and compare, on every rank, with
the single-device GPT trained by plain torch (same weights, same data, same AdamW and clipping).

Usage (under the deepspeed launcher):
    parity.py --out DIR --layouts 2,1,1 1,2,1 2,1,1,llama,sp,tied [--sequence-parallel]
A layout is tp,pp,dp, optionally followed by the Llama family (``llama``: 4 heads, 2 KV heads, SwiGLU width 96,
untied unless ``tied``), per-layout ``sp``, context parallelism ``cp<N>`` (ring; ``a2a`` for the all-to-all:
the world is then tp x cp x pp x dp and each CP rank trains on its chunks of every sequence), the ``dualpipev``
pipeline schedule (with ``zb``: ``dualpipev-zb``), ``interleaved`` (``interleaved-1f1b``, 2 virtual stages per
rank; with ``zb``: ``interleaved-zb``; ``l8``: 8 layers instead of 4, for pp 4) and a recompute policy
(``selective``, ``full``), and uneven pipeline stages (``blocks1-3``: ``pipeline_layout`` [1, 3]).  With
``replay`` the layout instead compares, with dropout on, each recompute policy's step-1 gradients with no
recompute's (DIR/<tp-pp-dp-options>.rank<r>.json).
The layout ``checkpoint`` runs ``schedule_checkpoint.py``'s checks (2 processes) into DIR/checkpoint,
``interleaved-checkpoint`` those of ``interleaved_checkpoint.py`` into DIR/interleaved-checkpoint.
``docs``: packed documents kept apart (``data.document_mask``, restart positions; token ids below 100 become
EOS), against the single-device model given the whole window's layout.
Writes DIR/<layout>.rank<r>.json with losses, gradient differences and gradient norms.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import log, micro_batches, tiny_ds_config, token_batches, write_result  # noqa: E402

from ds_megatron.checkpoint.layout import stage_param_layers  # noqa: E402
from ds_megatron.config import resolve  # noqa: E402
from ds_megatron.data.document_mask import document_layout  # noqa: E402
from ds_megatron.data.stream import DocumentMasking, split_batch  # noqa: E402
from ds_megatron.engine import build_engine  # noqa: E402
from ds_megatron.model import build_model, model_config  # noqa: E402
from ds_megatron.optim import param_groups  # noqa: E402
from ds_megatron.parallelize import shard_rule  # noqa: E402
from ds_megatron.pipeline_parallel.module import pipeline_param_name  # noqa: E402
from ds_megatron.tensor_parallel import shard  # noqa: E402

EOS = 0


def with_documents(tokens: torch.Tensor) -> torch.Tensor:
    """Random tokens made packed documents: every id below 100 becomes EOS (about one token in ten)."""
    return torch.where(tokens < 100, EOS, tokens)


def reference(run, batches, documents=None):
    """Plain single-device training: losses per step, step-1 gradients (before clipping) and grad norms."""
    torch.manual_seed(0)
    model = build_model(model_config(run.model), seed=run.section.train.seed)
    opt_cfg = run.ds_config["optimizer"]["params"]
    opt = torch.optim.AdamW(
        param_groups(model, opt_cfg["weight_decay"]),
        lr=opt_cfg["lr"],
        betas=tuple(opt_cfg["betas"]),
        eps=opt_cfg["eps"],
        fused=True,  # as the engine's (optim.adamw_kwargs)
    )
    losses, norms, grads = [], [], None
    for step, tokens in enumerate(batches):
        inputs = tokens[:, :-1]
        logits = model(inputs) if documents is None else model(inputs, *document_layout(inputs, EOS, documents))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), run.ds_config["gradient_clipping"])))
        opt.step()
        losses.append(float(loss))
    return losses, grads, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


# A collective recorded by autograd (e.g. a weight copy run with autograd on) makes every backward warn that it passes
# through an op without an autograd kernel; here that fails the launch instead of scrolling by.
warnings.filterwarnings("error", message=".*an autograd kernel was not registered.*")

LLAMA_FIELDS = {"family": "llama", "num_kv_heads": 2, "intermediate_size": 96, "rope_theta": 10000.0}


def run_layout(tp: int, pp: int, dp: int, args, options: tuple[str, ...] = ()) -> None:
    sp = args.sequence_parallel or "sp" in options
    cp = next((int(o[2:]) for o in options if o.startswith("cp")), 1)
    comm = "a2a" if "a2a" in options else "ring"
    layers = 8 if "l8" in options else 4
    cfg = tiny_ds_config(tp, pp, dp, sequence_parallel=sp, attention=args.attention, cp=cp, cp_comm=comm, layers=layers)
    if "interleaved" in options:
        cfg["ds_megatron"]["parallel"].update(
            pipeline_schedule="interleaved-zb" if "zb" in options else "interleaved-1f1b", virtual_stages=2
        )
    if "llama" in options:
        cfg["ds_megatron"]["model"].update(LLAMA_FIELDS, tie_word_embeddings="tied" in options)
    blocks = next((o for o in options if o.startswith("blocks")), None)
    if blocks is not None:  # blocks per stage, e.g. blocks0-1-3-0
        cfg["ds_megatron"]["parallel"]["pipeline_layout"] = [int(n) for n in blocks[len("blocks") :].split("-")]
    if "dualpipev" in options:  # with ``zb``: its weight gradients deferred into the drain
        cfg["ds_megatron"]["parallel"]["pipeline_schedule"] = "dualpipev-zb" if "zb" in options else "dualpipev"
    for policy in ("selective", "full"):  # full: one block per recomputed chunk
        if policy in options:
            cfg["ds_megatron"]["recompute"] = {"policy": policy}
    docs = "docs" in options
    if docs:
        cfg["ds_megatron"].setdefault("data", {})["document_mask"] = True
    run = resolve(cfg, int(os.environ["WORLD_SIZE"]))
    documents = DocumentMasking(EOS, run.section.data.document_positions) if docs else None
    built = build_engine(run)
    engine, topo, plan = built.engine, built.topology, built.parallel
    batches = token_batches(args.steps, run.global_batch_size, run.model.seq_length, run.model.vocab_size)
    if docs:
        batches = [with_documents(t) for t in batches]
    boundary_rows, boundary_extras = [], []

    def record(mod, inputs):
        x = inputs[0]  # the hidden states, or with packed documents (hidden, doc_ids, positions)
        hidden, extras = (x[0], x[1:]) if isinstance(x, tuple) else (x, ())
        boundary_rows.append(list(hidden.shape))
        boundary_extras.append([[str(t.dtype), list(t.shape), t.requires_grad] for t in extras])

    if topo.pp_rank > 0:  # what arrives from the previous stage
        engine.module.forward_funcs[0].register_forward_pre_hook(record)

    captured = {}

    def capture(optimizer, *_):
        if not captured:
            captured.update(
                {
                    id(p): p.grad.detach().clone()
                    for g in optimizer.param_groups
                    for p in g["params"]
                    if p.grad is not None
                }
            )

    engine.optimizer.register_step_pre_hook(capture)
    eval_loss = None
    if "interleaved" in options:  # its forward-only order (evaluation) on the first batch, before any step
        tokens = batches[0]
        it = iter(micro_batches(tokens, run.micro_batch_size, run.dp, topo.dp_rank, topo.cp_rank, topo.cp))
        engine.module.eval()
        eval_loss = float(engine.eval_batch(it))
        engine.module.train()
    losses, norms = [], []
    for tokens in batches:
        if docs:
            gas = tokens.shape[0] // (run.micro_batch_size * run.dp)
            mine = tokens.view(run.dp, gas, run.micro_batch_size, -1)[topo.dp_rank]
            it = iter([split_batch(mb, topo.cp_rank, topo.cp, documents) for mb in mine])
        else:
            it = iter(micro_batches(tokens, run.micro_batch_size, run.dp, topo.dp_rank, topo.cp_rank, topo.cp))
        losses.append(float(engine.train_batch(it)))
        norms.append(float(engine.get_global_grad_norm()))

    # The layout table's layers of this pipeline rank, in the optimizer's order, against what the engine built.
    built_layers = []
    for name, _ in engine.module.named_parameters():
        idx = pipeline_layout_index(name)
        if idx not in built_layers:
            built_layers.append(idx)
    table_layers = stage_param_layers(built.model_config, run, pp)[topo.pp_rank]
    ref_losses, ref_grads, ref_norms, ref_params = reference(run, batches, documents and documents.positions)
    grad_diff, param_diff, checked, norm_weights, grad_hashes = 0.0, 0.0, [], {}, {}
    for name, p in engine.module.named_parameters():
        full = pipeline_param_name(name, engine.module)
        assert full is not None, f"unmapped parameter {name}"
        rule = shard_rule(full, plan)
        expected_grad = shard(ref_grads[full], rule, topo.tp_rank, topo.tp)
        expected_param = shard(ref_params[full], rule, topo.tp_rank, topo.tp)
        got = captured[id(p)]
        assert got.shape == expected_grad.shape, (name, got.shape, expected_grad.shape)
        grad_diff = max(grad_diff, float((got - expected_grad).abs().max()))
        # the gradient's bytes, to compare schedules bit for bit (one entry per parameter and TP rank)
        grad_hashes[f"{full}@tp{topo.tp_rank}"] = hashlib.sha1(got.contiguous().numpy().tobytes()).hexdigest()
        param_diff = max(param_diff, float((p.detach() - expected_param).abs().max()))
        checked.append(full)
        if ".ln_" in full or "norm" in full:
            norm_weights[full] = {"got": p.detach().flatten().tolist(), "ref": ref_params[full].flatten().tolist()}
    family = [f"llama-{'tied' if 'tied' in options else 'untied'}"] if "llama" in options else []
    cp_part = [f"cp{cp}", *(["a2a"] if comm == "a2a" else [])] if cp > 1 else []
    extra = [o for o in ("dualpipev", "zb", "interleaved", "l8", "selective", "full") if o in options]
    extra += [blocks] if blocks else []
    doc_part = ["docs"] if docs else []
    layout = "-".join(
        [f"{tp}-{pp}-{dp}", *(["sp"] if sp else []), *family, *cp_part, *extra, *doc_part, args.attention]
    )
    log(layout, "losses", losses, "ref", ref_losses, "grad_diff", grad_diff, "norms", norms, ref_norms)
    write_result(
        args.out,
        layout,
        {
            "losses": losses,
            "ref_losses": ref_losses,
            "grad_diff": grad_diff,
            "param_diff": param_diff,
            "norms": norms,
            "ref_norms": ref_norms,
            "checked": checked,
            "engine": type(engine).__name__,
            "all_names": sorted(ref_params),
            "tp_rank": topo.tp_rank,
            "pp_rank": topo.pp_rank,
            "dp_rank": topo.dp_rank,
            "cp_rank": topo.cp_rank,
            "boundary_shapes": boundary_rows,
            "boundary_extras": boundary_extras,
            "norm_weights": norm_weights,
            "built_layers": built_layers,
            "table_layers": table_layers,
            "grad_hashes": grad_hashes,
            "eval_loss": eval_loss,
        },
    )


def pipeline_layout_index(local_name: str) -> int:
    """The layer index of one of DeepSpeed's parameter names (a tied module's is its first layer's: 0)."""
    head = local_name.split(".")[0]
    return 0 if head == "tied_modules" else int(head)


def run_replay(tp: int, pp: int, dp: int, args, options: tuple[str, ...]) -> None:
    """With dropout 0.1: one step without recompute and one with each recompute policy, same seed, same schedule;
    exact RNG replay makes the step's gradients equal bit for bit (the masks of the recomputed forward are the
    original forward's).  Writes each policy's largest gradient difference on this rank."""
    result = {}
    for policy in ("none", "selective", "full"):
        cfg = tiny_ds_config(tp, pp, dp, dropout=0.1, sequence_parallel="sp" in options)
        if "llama" in options:
            cfg["ds_megatron"]["model"].update(LLAMA_FIELDS, tie_word_embeddings="tied" in options)
        if "dualpipev" in options:
            cfg["ds_megatron"]["parallel"]["pipeline_schedule"] = "dualpipev"
        if "interleaved" in options:
            cfg["ds_megatron"]["parallel"].update(
                pipeline_schedule="interleaved-zb" if "zb" in options else "interleaved-1f1b", virtual_stages=2
            )
        cfg["ds_megatron"]["recompute"] = {"policy": policy}
        run = resolve(cfg, int(os.environ["WORLD_SIZE"]))
        engine = build_engine(run).engine
        grads = {}

        def capture(optimizer, *_, engine=engine, grads=grads):
            grads.update({n: p.grad.detach().clone() for n, p in engine.module.named_parameters()})

        engine.optimizer.register_step_pre_hook(capture)
        tokens = token_batches(1, run.global_batch_size, run.model.seq_length, run.model.vocab_size)[0]
        loss = float(engine.train_batch(iter(micro_batches(tokens, run.micro_batch_size, run.dp, 0))))
        if policy == "none":
            base = grads
        diff = max(float((grads[k] - base[k]).abs().max()) for k in base)
        result[policy] = {"loss": loss, "grad_diff": diff, "num_params": len(grads)}
    log("replay", options, result)
    write_result(args.out, "-".join([f"{tp}-{pp}-{dp}", *options]), result)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", nargs="+", required=True)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--attention", default="eager")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    for layout in args.layouts:
        if layout == "checkpoint":
            from schedule_checkpoint import run_checks

            run_checks(os.path.join(args.out, "checkpoint"))
            continue
        if layout == "interleaved-checkpoint":
            from interleaved_checkpoint import run_checks as run_interleaved_checks

            run_interleaved_checks(os.path.join(args.out, "interleaved-checkpoint"))
            continue
        fields = layout.split(",")
        tp, pp, dp = (int(x) for x in fields[:3])
        if "replay" in fields:
            run_replay(tp, pp, dp, args, tuple(fields[3:]))
        else:
            run_layout(tp, pp, dp, args, tuple(fields[3:]))


if __name__ == "__main__":
    main()
