"""``python -m ds_megatron.tune``: rank training configurations for a GPT or a Llama on a cluster, analytically
(seconds, no GPU); ``--empirical --max-minutes M`` then trains the top candidates for a few steps on this machine,
refits the time model and ranks again.  Exit status: 0 with a winner, 1 when nothing fits (the reasons are printed),
2 on bad input (one ``error:`` line)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import NoReturn

from ds_megatron.config import ConfigError
from ds_megatron.config.numbers import finite_float
from ds_megatron.config.rules import PIPELINE_ZERO_STAGES
from ds_megatron.config.schema import ATTENTION_KERNELS, RECOMPUTE_MODULES, RECOMPUTE_POLICIES
from ds_megatron.config.sizes import all_size_names
from ds_megatron.model import FAMILIES
from ds_megatron.tune import Pins, build_model_shape, empirical, search
from ds_megatron.tune.empirical_report import format_empirical
from ds_megatron.tune.gpus import DEFAULT_GPU, GPUS
from ds_megatron.tune.report import format_report
from ds_megatron.tune.schedules import ALL, DEFAULT_SCHEDULES, SCHEDULES
from ds_megatron.tune.spec import DEFAULT_EFFICIENCY, INTER_NODE_LATENCY_S, INTRA_NODE_LATENCY_S, cluster_from_flags
from ds_megatron.tune.written import check_output, to_json, write_config, write_output

CPU_KERNEL_NOTE = (
    "empirical on CPU: attention pinned to eager (with dropout on, torch's CPU sdpa falls back to its math path, the "
    "eager kernel's work; pass --attention sdpa to rank sdpa instead)"
)
EXIT_NO_FIT = 1
EXIT_CONFIG_ERROR = 2

INT, FLOAT = {"type": int}, {"type": finite_float}  # nan and inf are refused as they are parsed
SWITCH = {"action": argparse.BooleanOptionalAction, "default": None}  # --x, --no-x, or unset (None)
INTRA_US, INTER_US = INTRA_NODE_LATENCY_S * 1e6, INTER_NODE_LATENCY_S * 1e6
# The command line: argument group -> (flag, add_argument's keywords, help) rows.
FLAGS = {
    "model": (
        ("--model", {}, f"named size: {', '.join(all_size_names())}"),
        ("--family", {"choices": tuple(FAMILIES)}, "model family of an explicit shape (default gpt2)"),
        ("--layers", INT, "transformer blocks L (overrides --model)"),
        ("--hidden", INT, "hidden size h (overrides --model)"),
        ("--heads", INT, "attention heads a (overrides --model)"),
        ("--kv-heads", INT, "llama: grouped-query attention's KV heads (default: --heads)"),
        ("--intermediate-size", INT, "llama: SwiGLU width F (overrides --model)"),
        (
            "--tie-word-embeddings",
            SWITCH,
            "llama: output layer tied to the embedding (default: the named size's, else untied)",
        ),
        ("--vocab", INT, "vocabulary size V (default: the named size's, else 50257 or 128256)"),
        ("--seq-length", INT, "sequence length s (default: the named size's, else 2048 or 8192)"),
        ("--global-batch-size", INT | {"required": True}, "sequences per optimizer step"),
    ),
    "cluster": (
        ("--gpus", INT | {"required": True}, "total GPUs"),
        ("--gpus-per-node", INT | {"default": 8}, "GPUs per node (default 8)"),
        (
            "--gpu",
            {"choices": list(GPUS)},
            f"GPU preset: memory, peak, HBM, NVLink and network figures (default: {DEFAULT_GPU}'s figures); the flags "
            "below override it",
        ),
        ("--gpu-memory-gb", FLOAT, "memory per GPU in GiB (A100-80GB: 80)"),
        ("--gpu-peak-tflops", FLOAT, "dense bf16 peak per GPU (A100: 312)"),
        ("--memory-gbps", FLOAT, "HBM bandwidth per GPU in GB/s (A100-80GB: 2039)"),
        ("--intra-node-gbps", FLOAT, "NVLink GB/s per GPU, one way (A100: 300)"),
        ("--inter-node-gbps", FLOAT, "network GB/s per GPU, one way (200 Gb/s HDR: 25)"),
        (
            "--efficiency",
            FLOAT | {"default": DEFAULT_EFFICIENCY},
            f"ceiling of the matmul-efficiency curve, the fraction of peak a very large GEMM reaches (default "
            f"{DEFAULT_EFFICIENCY}, fitted on published A100 step times; fit yours with --empirical or tune.calibrate)",
        ),
        (
            "--intra-node-latency-us",
            FLOAT | {"default": INTRA_US},
            f"fixed cost of a collective or send inside a node (default {INTRA_US:g})",
        ),
        ("--inter-node-latency-us", FLOAT | {"default": INTER_US}, f"the same across nodes (default {INTER_US:g})"),
        (
            "--step-overhead-s",
            FLOAT | {"default": 0.0},
            "fixed seconds per step outside the model (default 0; --empirical on CPU fits it)",
        ),
    ),
    "pins (fix a dimension; the rest is searched)": (
        ("--tp", INT, "tensor-parallel size"),
        ("--cp", INT, "context-parallel size (default: searched from 16384 tokens on, else 1)"),
        ("--cp-comm", {"metavar": "ring|a2a"}, "CP attention exchange, with --cp N > 1 (default: both searched)"),
        ("--pp", INT, "pipeline-parallel size"),
        ("--dp", INT, "data-parallel size"),
        ("--micro-batch-size", INT, "micro-batch size b"),
        ("--sequence-parallel", SWITCH, "SP on or off"),
        ("--recompute", {"choices": RECOMPUTE_POLICIES}, "recompute policy"),
        (
            "--recompute-modules",
            {"metavar": "A,B"},
            f"what selective recompute recomputes, from {','.join(RECOMPUTE_MODULES)} (implies --recompute selective; "
            "default: searched per kernel)",
        ),
        ("--attention", {"choices": ATTENTION_KERNELS}, "attention kernel (sdpa never with core_attn)"),
        ("--zero", INT | {"choices": PIPELINE_ZERO_STAGES}, "ZeRO stage"),
        (
            "--schedule",
            {"metavar": "|".join((*SCHEDULES, ALL))},
            f"pipeline schedule (default: {', '.join(DEFAULT_SCHEDULES)} only; {ALL}: rank every schedule together)",
        ),
    ),
    "output": (
        ("--top", INT | {"default": 10}, "rows of the ranked table (default 10)"),
        ("--json", {"metavar": "OUT"}, "write every candidate and every rejected family to OUT"),
        ("--write-config", {"metavar": "PATH"}, "write the winner as a ds_configs-style JSON"),
        ("--force", {"action": "store_true"}, "replace the files of --json and --write-config if they exist"),
    ),
    "empirical mode (short real runs of the top candidates on this machine, then recalibrate)": (
        ("--empirical", {"action": "store_true"}, "measure the top candidates with recipes/train_gpt.py"),
        ("--max-minutes", FLOAT, "wall-clock budget of the whole command (required)"),
        ("--empirical-top", INT | {"default": 3}, "candidates to measure (default 3)"),
        ("--empirical-steps", INT | {"default": 10}, "measured steps per run (default 10)"),
        ("--empirical-warmup", INT | {"default": 3}, "warm-up steps dropped per run (default 3)"),
        ("--device", {"choices": empirical.DEVICES, "default": "auto"}, "auto: gpu when torch sees CUDA, else cpu"),
        ("--empirical-dir", {"metavar": "DIR"}, "run directories (default runs/tune/<date-time>)"),
        (
            "--empirical-set",
            {"action": "append", "default": [], "metavar": "KEY=VALUE"},
            "--set for every run, e.g. ds_megatron.data.path=corpus.txt or ds_megatron.data.cache_dir=DIR",
        ),
    ),
}


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one ConfigError line instead of usage + message."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError("command line", message, "python -m ds_megatron.tune --help lists the flags", "fix the flag")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m ds_megatron.tune",
        description="Find the fastest TP/PP/DP/SP/micro-batch/recompute/attention/ZeRO configuration for a GPT or a "
        "Llama, analytically.",
    )
    for title, rows in FLAGS.items():
        group = p.add_argument_group(title)
        for flag, options, text in rows:
            group.add_argument(flag, **options, help=text)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["inference"]:  # the serving half: python -m ds_megatron.tune inference ...
        from ds_megatron.tune.inference_cli import main as inference_main

        return inference_main(argv[1:])
    start = time.monotonic()
    try:
        return _run(build_parser().parse_args(argv), start)
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return EXIT_CONFIG_ERROR


def _run(args: argparse.Namespace, start: float) -> int:
    """Search, print the report, measure (--empirical), write --json and --write-config; the exit status."""
    if args.empirical and args.max_minutes is None:
        raise ConfigError("--max-minutes", "required with --empirical", "not set", "pass e.g. --max-minutes 10")
    check_output("--json", args.json, args.force)
    check_output("--write-config", args.write_config, args.force)
    if args.json and args.write_config and Path(args.json).resolve() == Path(args.write_config).resolve():
        values = f"--json {args.json}, --write-config {args.write_config}"
        raise ConfigError("--write-config", "names the same file as --json", values, "pass two different paths")
    llama = {name: getattr(args, name) for name in ("family", "kv_heads", "intermediate_size", "tie_word_embeddings")}
    model = build_model_shape(args.model, args.layers, args.hidden, args.heads, args.vocab, args.seq_length, **llama)
    cluster = cluster_from_flags(args)
    pinned = {f.name: getattr(args, f.name) for f in dataclasses.fields(Pins)}  # every pin is the flag of its name
    if args.recompute_modules is not None:  # "mlp_act,layernorm"; the names are checked with the other pins
        pinned["recompute_modules"] = tuple(n.strip() for n in args.recompute_modules.split(",") if n.strip())
    pins = Pins(**pinned)
    result = search(model, cluster, args.global_batch_size, pins)
    options = None
    if args.empirical:
        options = empirical.EmpiricalOptions(
            max_minutes=args.max_minutes,
            top=args.empirical_top,
            steps=args.empirical_steps,
            warmup=args.empirical_warmup,
            device=args.device,
            work_dir=args.empirical_dir,
            extra_sets=tuple(args.empirical_set),
        )
        empirical.validate_options(result, options)
        options = dataclasses.replace(options, device=empirical.resolve_device(options.device, cluster.num_gpus))
    # The CPU runs cannot tell the kernels apart (CPU_KERNEL_NOTE): rank and measure eager, which also allows
    # selective recompute of the attention core.
    cpu_eager = options is not None and options.device == "cpu" and pins.attention is None
    if cpu_eager:
        result = search(model, cluster, args.global_batch_size, dataclasses.replace(pins, attention="eager"))
    top = max(1, args.top)
    print(format_report(result, top=top), flush=True)
    if cpu_eager:
        print(CPU_KERNEL_NOTE)
    emp = None
    if options is not None and result.winner is None:
        print("empirical: skipped, no candidate fits")
    elif options is not None:
        say = functools.partial(print, flush=True)
        emp = empirical.run_empirical(result, options, deadline=start + 60 * args.max_minutes, say=say)
        print(format_empirical(emp, result.global_batch_size, result.model.seq_length, top=top))
    if args.json:
        data = to_json(result)
        if emp is not None:
            data["empirical"] = emp.as_dict(top=top)
        write_output("--json", args.json, json.dumps(data, indent=1), args.force)
        print(
            f"wrote {len(result.evaluations)} candidates and {len(result.rejections)} rejected families to {args.json}"
        )
    if result.winner is None:
        if args.write_config:
            print(f"no config written to {args.write_config}: nothing fits", file=sys.stderr)
        return EXIT_NO_FIT
    if args.write_config:
        final = emp.winner if emp is not None else None
        command = write_config(result, args.write_config, final.evaluation if final else result.winner, args.force)
        which = "the final (empirical) winner" if final else "the winner"
        print(f"wrote {which} to {args.write_config}; launch it with:\n  {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
