"""L5: the training entry point behind ``recipes/train_gpt.py``.

    deepspeed [--num_gpus N | --hostfile H] recipes/train_gpt.py --deepspeed_config ds_configs/<size>.json [flags]

The JSON holds the whole run; flags override single values.  Everything is validated before the process group
exists: a bad setting prints one ``error: ...`` line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

from ds_megatron.config import ConfigError, load_json, resolve

EXIT_CONFIG_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train_gpt.py",
        description="Train a GPT with Megatron tensor/sequence parallelism in a DeepSpeed pipeline.",
    )
    p.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON with a 'ds_megatron' section")
    p.add_argument("--tp", type=int, help="override ds_megatron.parallel.tp")
    p.add_argument("--pp", type=int, help="override ds_megatron.parallel.pp")
    p.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="override ds_megatron.parallel.sequence_parallel",
    )
    p.add_argument("--train-iters", type=int, help="override ds_megatron.train.train_iters")
    p.add_argument("--log-interval", type=int, help="override ds_megatron.train.log_interval")
    p.add_argument("--seed", type=int, help="override ds_megatron.train.seed")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any key by dotted path; VALUE is parsed as JSON when it can be "
        "(e.g. --set ds_megatron.model.dropout=0.0 --set train_micro_batch_size_per_gpu=4)",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks for configuration errors")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)), help=argparse.SUPPRESS)
    return p


def _set_path(cfg: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = cfg
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}", "parent is not an object", f"{key}={node!r}", "use a valid path")
    node[leaf] = value


def apply_overrides(cfg: dict, args: argparse.Namespace) -> dict:
    flags = {
        "ds_megatron.parallel.tp": args.tp,
        "ds_megatron.parallel.pp": args.pp,
        "ds_megatron.parallel.sequence_parallel": args.sequence_parallel,
        "ds_megatron.train.train_iters": args.train_iters,
        "ds_megatron.train.log_interval": args.log_interval,
        "ds_megatron.train.seed": args.seed,
    }
    for path, value in flags.items():
        if value is not None:
            _set_path(cfg, path, value)
    for item in args.set:
        if "=" not in item:
            raise ConfigError(
                "--set", "expected KEY=VALUE", f"got {item!r}", "write e.g. --set ds_megatron.train.seed=1"
            )
        key, raw = item.split("=", 1)
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        _set_path(cfg, key, value)
    return cfg


def validate(argv: list[str] | None = None):
    """Parse flags and validate the config for this launch's world size; no side effects."""
    args = build_parser().parse_args(argv)
    cfg = apply_overrides(load_json(args.deepspeed_config), args)
    run = resolve(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    return args, run


def main(argv: list[str] | None = None) -> int:
    try:
        args, run = validate(argv)
    except ConfigError as err:
        if "--debug" in (argv or sys.argv):
            raise
        print(str(err), file=sys.stderr)
        return EXIT_CONFIG_ERROR
    train(run)
    return 0


def train(run) -> None:
    import torch

    from ds_megatron.data import MicroBatchStream, builtin_corpus_bytes, split_train_valid
    from ds_megatron.engine import build_engine

    built = build_engine(run)
    engine, topo = built.engine, built.topology
    section = run.section
    say = print if topo.is_logging_rank else (lambda *a, **k: None)
    if topo.rank == 0:
        print("resolved configuration:\n" + json.dumps(run.ds_config, indent=2), flush=True)

    tokens = builtin_corpus_bytes()
    if int(tokens.max()) >= run.model.vocab_size:
        raise SystemExit(
            f"error: ds_megatron.model.vocab_size: smaller than the byte tokenizer's vocabulary "
            f"({run.model.vocab_size} < {int(tokens.max()) + 1}); set vocab_size to at least 257"
        )
    train_tokens, valid_tokens = split_train_valid(tokens)
    seed = section.train.seed
    stream = MicroBatchStream(
        train_tokens, run.model.seq_length, run.micro_batch_size, run.grad_accum_steps, topo.dp_rank, run.dp, seed
    )
    tokens_per_step = run.global_batch_size * run.model.seq_length
    iters, log_every = section.train.train_iters, section.train.log_interval
    say(f"training {iters} steps: tp {run.tp} pp {run.pp} dp {run.dp}, {tokens_per_step} tokens per step", flush=True)
    window_start, window_loss, window_steps = time.time(), 0.0, 0
    for step in range(1, iters + 1):
        loss = float(engine.train_batch(stream))
        window_loss, window_steps = window_loss + loss, window_steps + 1
        if step % log_every == 0 or step == iters:
            elapsed = time.time() - window_start
            norm = engine.get_global_grad_norm()
            norm = float(norm) if norm is not None else float("nan")
            rate = tokens_per_step * window_steps / elapsed
            say(
                f"step {step:>6}/{iters} | loss {window_loss / window_steps:.4f} | lr {engine.get_lr()[0]:.3e} | "
                f"grad norm {norm:.3f} | {rate:,.0f} tokens/s | {1000 * elapsed / window_steps:.0f} ms/step",
                flush=True,
            )
            window_start, window_loss, window_steps = time.time(), 0.0, 0

    valid = MicroBatchStream(
        valid_tokens, run.model.seq_length, run.micro_batch_size, run.grad_accum_steps, topo.dp_rank, run.dp, seed + 1
    )
    losses = [float(engine.eval_batch(valid)) for _ in range(section.train.eval_iters)]
    val = sum(losses) / len(losses)
    say(f"validation | loss {val:.4f} | perplexity {math.exp(min(val, 50)):.2f}", flush=True)
    torch.distributed.barrier()
