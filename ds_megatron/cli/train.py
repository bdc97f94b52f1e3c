"""L5: the training entry point behind ``recipes/train_gpt.py``.

    deepspeed [--num_gpus N | --hostfile H] recipes/train_gpt.py --deepspeed_config ds_configs/<size>.json [flags]

The JSON holds the whole run; flags override single values.  Everything is validated before the process group
exists: a bad setting prints one ``error: ...`` line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ds_megatron.config import ConfigError, load_json, resolve

EXIT_CONFIG_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train_gpt.py",
        description="Train a GPT with Megatron tensor/sequence parallelism in a DeepSpeed pipeline.",
        epilog="Everything else: --set dotted.key=value (e.g. --set ds_megatron.model.dropout=0.0).",
    )
    p.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON with a 'ds_megatron' section")
    p.add_argument("--tp", type=int, help="ds_megatron.parallel.tp")
    p.add_argument("--pp", type=int, help="ds_megatron.parallel.pp")
    p.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ds_megatron.parallel.sequence_parallel",
    )
    p.add_argument(
        "--recompute",
        help="ds_megatron.recompute: none | selective | full[:K[:uniform|block]] (e.g. full:2:block)",
    )
    p.add_argument("--train-iters", type=int, help="ds_megatron.train.train_iters")
    p.add_argument("--log-interval", type=int, help="ds_megatron.train.log_interval")
    p.add_argument("--eval-interval", type=int, help="ds_megatron.train.eval_interval (0: only at the end)")
    p.add_argument("--seed", type=int, help="ds_megatron.train.seed")
    p.add_argument("--data", help="ds_megatron.data.path: HF dataset name, or .txt/.json/.jsonl/.parquet files/globs")
    p.add_argument("--tokenizer", help="ds_megatron.data.tokenizer: a tokenizer directory or bpe:N")
    p.add_argument("--save", help="ds_megatron.checkpoint.save: checkpoint directory")
    p.add_argument("--save-interval", type=int, help="ds_megatron.checkpoint.save_interval")
    p.add_argument("--load", help="ds_megatron.checkpoint.load: resume from this checkpoint directory")
    p.add_argument("--init-from-hf", help="start from the weights of a transformers GPT-2 directory (e.g. an export)")
    p.add_argument("--wandb-project", help="ds_megatron.logging.wandb_project (offline without credentials)")
    p.add_argument("--peak-tflops", type=float, help="ds_megatron.logging.peak_tflops, for MFU")
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
        "ds_megatron.train.eval_interval": args.eval_interval,
        "ds_megatron.train.seed": args.seed,
        "ds_megatron.data.path": args.data,
        "ds_megatron.data.tokenizer": args.tokenizer,
        "ds_megatron.checkpoint.save": args.save,
        "ds_megatron.checkpoint.save_interval": args.save_interval,
        "ds_megatron.checkpoint.load": args.load,
        "ds_megatron.checkpoint.init_from_hf": args.init_from_hf,
        "ds_megatron.logging.wandb_project": args.wandb_project,
        "ds_megatron.logging.peak_tflops": args.peak_tflops,
    }
    if args.recompute is not None:
        parts = args.recompute.split(":")
        _set_path(cfg, "ds_megatron.recompute.policy", parts[0])
        if len(parts) > 1:
            if not parts[1].isdigit():
                raise ConfigError("--recompute", "K must be an integer", f"got {args.recompute!r}", "e.g. full:2:block")
            _set_path(cfg, "ds_megatron.recompute.num_layers", int(parts[1]))
        if len(parts) > 2:
            _set_path(cfg, "ds_megatron.recompute.method", parts[2])
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
    check_inputs(run)
    return args, run


def check_inputs(run) -> None:
    """What can be checked before any process group: data files, tokenizer, checkpoint directory."""
    from ds_megatron.config import check_tokenizer, effective_tokenizer

    data = run.section.data
    check_tokenizer(effective_tokenizer(run), run.model.vocab_size)
    if data.path is not None:
        from ds_megatron.data.corpus import is_local, resolve_files

        if is_local(data.path):
            files = resolve_files(data.path)
            if not files:
                raise ConfigError("ds_megatron.data.path", "no file matches", data.path, "check the path or glob")
            if all(os.path.getsize(f) == 0 for f in files):
                raise ConfigError(
                    "ds_megatron.data.path", "the dataset is empty", f"{len(files)} file(s) of 0 bytes", "add some text"
                )
    spec = effective_tokenizer(run)
    if not spec.startswith("bpe:"):
        from transformers import AutoTokenizer

        size = len(AutoTokenizer.from_pretrained(spec))
        if size > run.model.vocab_size:
            raise ConfigError(
                "ds_megatron.data.tokenizer",
                "tokenizer vocabulary larger than the model's",
                f"{size} tokens in {spec} > vocab_size {run.model.vocab_size}",
                f"set ds_megatron.model.vocab_size to at least {size}",
            )
    init = run.section.checkpoint.init_from_hf
    if init is not None:
        if not (Path(init) / "config.json").is_file():
            raise ConfigError(
                "ds_megatron.checkpoint.init_from_hf",
                "not a transformers model directory",
                f"{init} has no config.json",
                "pass a directory written by `python -m ds_megatron.checkpoint export` or save_pretrained",
            )
        from ds_megatron.checkpoint.hf_import import check_hf_config
        from ds_megatron.model import GPTConfig

        try:
            check_hf_config(Path(init), GPTConfig.from_shape(run.model))
        except ValueError as err:
            problem, _, fix = str(err).removeprefix("error: --init-from-hf: ").partition("; ")
            raise ConfigError("ds_megatron.checkpoint.init_from_hf", problem, init, fix) from None
    load = run.section.checkpoint.load
    if load is not None:
        check_resume(run, Path(load))


SHAPE_KEYS = ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_length", "max_position_embeddings")


def check_resume(run, load: Path) -> None:
    """``--load`` needs a complete checkpoint whose model and layout match this run."""
    from ds_megatron.checkpoint.manifest import newest_complete_tag, tag_config
    from ds_megatron.config import resolve

    tag = newest_complete_tag(load)
    if tag is None:
        raise ConfigError(
            "ds_megatron.checkpoint.load",
            "no complete checkpoint there",
            f"{load} has no tag with a manifest",
            "pass a directory written by --save (incomplete tags from a crash are skipped)",
        )
    saved = tag_config(load, tag)
    if saved is None:
        return
    try:
        old = resolve(saved, saved_world(saved))
    except ConfigError:
        return
    for key in SHAPE_KEYS:
        a, b = getattr(old.model, key), getattr(run.model, key)
        if a != b:
            raise ConfigError(
                "ds_megatron.checkpoint.load",
                f"checkpoint model shape does not match the config ({key})",
                f"{key}={a} in {load}/{tag}, {b} in the config",
                f"set ds_megatron.model.{key}={a} or start a new run",
            )
    if (old.tp, old.pp) != (run.tp, run.pp) and (_mixed_or_zero(old.ds_config) or _mixed_or_zero(run.ds_config)):
        raise ConfigError(
            "ds_megatron.checkpoint.load",
            "a bf16/fp16/ZeRO checkpoint resumes only at the tp x pp it was saved at",
            f"tp {old.tp} x pp {old.pp} in {load}/{tag}, tp {run.tp} x pp {run.pp} now",
            f"resume with --tp {old.tp} --pp {old.pp}, or export and restart with --init-from-hf",
        )


def _mixed_or_zero(cfg: dict) -> bool:
    zero = (cfg.get("zero_optimization") or {}).get("stage", 0)
    half = (cfg.get("bf16") or {}).get("enabled") or (cfg.get("fp16") or {}).get("enabled")
    return bool(half or zero)


def saved_world(cfg: dict) -> int:
    """The world size a saved config was resolved for (from its batch arithmetic)."""
    par = cfg.get("ds_megatron", {}).get("parallel", {})
    tp, pp = par.get("tp", 1), par.get("pp", 1)
    micro, gas, glob = (
        cfg.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    )
    dp = glob // (micro * gas) if micro and gas and glob else 1
    return tp * pp * dp


def main(argv: list[str] | None = None) -> int:
    try:
        args, run = validate(argv)
    except ConfigError as err:
        if "--debug" in (argv if argv is not None else sys.argv):
            raise
        # Every rank of a launch validates the same config and exits; one of them says why.
        if os.environ.get("RANK", "0") == "0":
            print(str(err), file=sys.stderr)
        return EXIT_CONFIG_ERROR
    from ds_megatron.cli.loop import train

    return train(run, config_name=os.path.splitext(os.path.basename(args.deepspeed_config))[0])
