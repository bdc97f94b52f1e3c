"""L5: the training entry point behind ``recipes/train_gpt.py``.

    deepspeed [--num_gpus N | --hostfile H] recipes/train_gpt.py --deepspeed_config ds_configs/<size>.json [flags]

The JSON holds the whole run; flags override single values.  Everything is validated before the process group
exists: a bad setting prints one ``error: ...`` line and exits with status 2.  The same command runs under srun
(``deepspeed --launcher slurm``) and mpirun (``--launcher openmpi``): their rank variables are adopted first
(``launch_env``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from ds_megatron.checkpoint.run_lock import hold_run_lock
from ds_megatron.config import ConfigError, DsMegatronConfig, load_json, resolve
from ds_megatron.config.deepspeed_keys import is_known_top_level, nearest_top_level, unknown_top_level_warnings
from ds_megatron.config.pipeline_checks import block_counts
from ds_megatron.launch_env import adopt_launcher_env, order_cuda_connections
from ds_megatron.preflight import check_run
from ds_megatron.stop import StopFlag

EXIT_CONFIG_ERROR = 2


# One table for the flags that set a single config value: (flag, dotted config path, type, help).  It generates the
# argparse flags and the overrides both.
VALUE_FLAGS: tuple[tuple[str, str, type | None, str], ...] = (
    ("--tp", "ds_megatron.parallel.tp", int, ""),
    ("--cp", "ds_megatron.parallel.cp", int, ": context parallel (each sequence split over cp ranks)"),
    ("--cp_comm", "ds_megatron.parallel.cp_comm", None, ': "ring" or "a2a"'),
    ("--ep", "ds_megatron.parallel.ep", int, ": expert parallel (routed experts split over ep ranks; MoE families)"),
    ("--expert-tp", "ds_megatron.parallel.expert_tp", int, ": each routed expert split over 1 or tp ranks"),
    ("--pp", "ds_megatron.parallel.pp", int, ""),
    ("--virtual-stages", "ds_megatron.parallel.virtual_stages", int, ": model chunks per pipeline rank"),
    (
        "--pipeline-layout",
        "ds_megatron.parallel.pipeline_layout",
        None,
        ": blocks per pipeline stage in model order, e.g. 3,5,5,3 (pp x stages per rank counts)",
    ),
    ("--train-iters", "ds_megatron.train.train_iters", int, ""),
    ("--log-interval", "ds_megatron.train.log_interval", int, ""),
    ("--eval-interval", "ds_megatron.train.eval_interval", int, " (0: only at the end)"),
    ("--seed", "ds_megatron.train.seed", int, ""),
    (
        "--data",
        "ds_megatron.data.path",
        None,
        ": HF dataset name, .txt/.json/.jsonl/.parquet files/globs, a prepared directory, or the PREFIX of a "
        "Megatron-LM / GPT-NeoX PREFIX.bin + PREFIX.idx pair (with --tokenizer)",
    ),
    ("--tokenizer", "ds_megatron.data.tokenizer", None, ": a tokenizer directory or bpe:N"),
    ("--save", "ds_megatron.checkpoint.save", None, ": checkpoint directory"),
    ("--save-interval", "ds_megatron.checkpoint.save_interval", int, ""),
    ("--load", "ds_megatron.checkpoint.load", None, ": resume from this checkpoint directory"),
    ("--init-from-hf", "ds_megatron.checkpoint.init_from_hf", None, ": start from a transformers model directory"),
    ("--wandb-project", "ds_megatron.logging.wandb_project", None, " (offline without credentials)"),
    ("--peak-tflops", "ds_megatron.logging.peak_tflops", float, ", for MFU"),
)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train_gpt.py",
        description="Train a GPT-2 or Llama model with Megatron tensor/sequence parallelism in a DeepSpeed pipeline.",
        epilog="Everything else: --set dotted.key=value (e.g. --set ds_megatron.model.dropout=0.0).",
    )
    p.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON with a 'ds_megatron' section")
    for flag, path, kind, note in VALUE_FLAGS:
        p.add_argument(flag, type=kind, help=path + note)
    p.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ds_megatron.parallel.sequence_parallel",
    )
    p.add_argument(
        "--eval-only",
        action="store_true",
        default=None,
        help="ds_megatron.train.eval_only: report the validation loss of what --load or --init-from-hf loads, train "
        "nothing",
    )
    p.add_argument(
        "--recompute",
        help="ds_megatron.recompute: none | selective | full[:K[:uniform|block]] (e.g. full:2:block)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any key by dotted path; VALUE is parsed as JSON when it can be "
        "(e.g. --set ds_megatron.model.dropout=0.0 --set train_micro_batch_size_per_gpu=4). A weighted blend of "
        "prepared directories, instead of --data: "
        """--set 'ds_megatron.data.blend=[["web.prepared", 0.7], ["code.prepared", 0.3]]'""",
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
    flags = {path: getattr(args, _dest(flag)) for flag, path, _, _ in VALUE_FLAGS}
    flags["ds_megatron.parallel.sequence_parallel"] = args.sequence_parallel
    flags["ds_megatron.train.eval_only"] = args.eval_only
    if args.pipeline_layout is not None:
        flags["ds_megatron.parallel.pipeline_layout"] = block_counts(args.pipeline_layout, "--pipeline-layout")
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
        check_set_path(key)
        _set_path(cfg, key, parse_set_value(key, raw))
    return cfg


def parse_set_value(key: str, raw: str) -> Any:
    """JSON when it parses, else the text itself; but text that starts like a JSON list or object was meant as one
    (a blend, a tuple), and kept as text it would only be refused later as a mistyped value."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as err:
        if raw.lstrip().startswith(("[", "{")):
            raise ConfigError(
                f"--set {key}",
                "not valid JSON",
                f"{err.msg} at character {err.pos} of {raw!r}",
                "double-quote the strings inside and single-quote the whole for the shell, e.g. "
                f"""--set '{key}=[["web.prepared", 0.7], ["code.prepared", 0.3]]'""",
            ) from None
        return raw


def check_set_path(dotted: str) -> None:
    """A ``--set`` path must start with a DeepSpeed key or ``ds_megatron`` (DeepSpeed would ignore anything else)."""
    top = dotted.split(".")[0]
    if is_known_top_level(top):
        return
    section = ds_megatron_path(dotted)
    fix = f"did you mean ds_megatron.{dotted}?" if section else f"did you mean {nearest_top_level(top) or '...'}?"
    raise ConfigError(f"--set {dotted}", "neither a DeepSpeed key nor under ds_megatron", f"top-level key {top!r}", fix)


def ds_megatron_path(dotted: str) -> bool:
    """Whether ``ds_megatron.<dotted>`` names a field of the ds_megatron section."""
    node: object = DsMegatronConfig()
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return False
        node = getattr(node, part)
    return True


def validate(argv: list[str] | None = None):
    """Parse flags and validate the config for this launch's world size; no side effects."""
    args = build_parser().parse_args(argv)
    cfg = apply_overrides(load_json(args.deepspeed_config), args)
    run = resolve(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    check_run(run)
    return args, run


def main(argv: list[str] | None = None) -> int:
    # First, before anything slow: a stop sent during start-up is kept (stop.py), not lost.
    stop = StopFlag()
    try:
        adopt_launcher_env()
        args, run = validate(argv)
        order_cuda_connections(run.tp)  # before anything imports torch, let alone starts CUDA
        # One training per --save directory, for the run's life; refused before any process group or file exists.
        lock = hold_run_lock(run, holder=os.environ.get("RANK", "0") == "0")
    except ConfigError as err:
        if "--debug" in (argv if argv is not None else sys.argv):
            raise
        # Every rank of a launch validates the same config and exits; one of them says why.
        if os.environ.get("RANK", "0") == "0":
            print(str(err), file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if os.environ.get("RANK", "0") == "0":
        for line in unknown_top_level_warnings(run.ds_config):
            print(line, file=sys.stderr, flush=True)
    from ds_megatron.trainer import train

    with lock:
        return train(run, config_name=os.path.splitext(os.path.basename(args.deepspeed_config))[0], stop=stop)
