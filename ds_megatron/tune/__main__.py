"""``python -m ds_megatron.tune``: rank training configurations for a GPT or a Llama on a cluster, analytically
(seconds, no GPU); ``--empirical --max-minutes M`` then trains the top candidates for a few steps on this machine,
refits the time model and ranks again.  Exit status: 0 with a winner, 1 when nothing fits (the reasons are printed),
2 on bad input (one ``error:`` line)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ds_megatron.config import ConfigError
from ds_megatron.config.rules import PIPELINE_ZERO_STAGES
from ds_megatron.config.schema import ATTENTION_KERNELS, RECOMPUTE_MODULES, RECOMPUTE_POLICIES
from ds_megatron.tune import Pins, build_model_shape, search
from ds_megatron.tune.core import cli
from ds_megatron.tune.core.cli import INT, SWITCH, check_output, write_output
from ds_megatron.tune.core.spec import cluster_from_flags
from ds_megatron.tune.training import empirical
from ds_megatron.tune.training.empirical_report import format_empirical
from ds_megatron.tune.training.report import format_report
from ds_megatron.tune.training.schedules import ALL, DEFAULT_SCHEDULES, SCHEDULES, STAGED
from ds_megatron.tune.training.written import to_json, write_config

CPU_KERNEL_NOTE = (
    "empirical on CPU: attention pinned to eager (with dropout on, torch's CPU sdpa falls back to its math path, the "
    "eager kernel's work; pass --attention sdpa to rank sdpa instead)"
)
# The command line: argument group -> (flag, add_argument's keywords, help) rows; the model and cluster rows and the
# empirical mode's are the core's, which the inference subcommand builds from too.
FLAGS = {
    "model": (*cli.MODEL_FLAGS, ("--global-batch-size", INT | {"required": True}, "sequences per optimizer step")),
    "cluster": cli.CLUSTER_FLAGS,
    "pins (fix a dimension; the rest is searched)": (
        ("--tp", INT, "tensor-parallel size"),
        ("--cp", INT, "context-parallel size (default: searched from 16384 tokens on, else 1)"),
        ("--cp-comm", {"metavar": "ring|a2a"}, "CP attention exchange, with --cp N > 1 (default: both searched)"),
        ("--pp", INT, "pipeline-parallel size"),
        ("--dp", INT, "data-parallel size"),
        ("--ep", INT, "expert-parallel size of a routed family (default: every ep its layout's rules accept)"),
        (
            "--expert-tp",
            INT,
            "ranks each routed expert's width is split over, 1 or tp (default: tp at ep 1; 1 and tp at ep > 1)",
        ),
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
        (
            "--virtual-stages",
            INT,
            f"model chunks per pipeline rank v, with --schedule {' or '.join(STAGED)} (default: every v >= 2 that "
            "divides the layers per stage)",
        ),
    ),
    "output": (
        ("--top", INT | {"default": 10}, "rows of the ranked table (default 10)"),
        ("--json", {"metavar": "OUT"}, "write every candidate and every rejected family to OUT"),
        ("--write-config", {"metavar": "PATH"}, "write the winner as a ds_configs-style JSON"),
        ("--force", {"action": "store_true"}, "replace the files of --json and --write-config if they exist"),
    ),
    "empirical mode (short real runs of the top candidates on this machine, then recalibrate)": (
        *cli.empirical_flags(
            "measure the top candidates with recipes/train_gpt.py",
            top=(3, "candidates to measure"),
            steps=(10, "measured steps per run"),
            warmup=(3, "warm-up steps dropped per run"),
            dirs="run directories (default runs/tune/<date-time>)",
        ),
        (
            "--empirical-set",
            {"action": "append", "default": [], "metavar": "KEY=VALUE"},
            "--set for every run, e.g. ds_megatron.data.path=corpus.txt or ds_megatron.data.cache_dir=DIR",
        ),
    ),
}


def build_parser() -> argparse.ArgumentParser:
    description = (
        "Find the fastest TP/PP/DP/SP/micro-batch/recompute/attention/ZeRO configuration for a GPT or a Llama, "
        "analytically."
    )
    return cli.build_parser("python -m ds_megatron.tune", description, FLAGS)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["inference"]:  # the serving half: python -m ds_megatron.tune inference ...
        from ds_megatron.tune.inference.cli import main as inference_main

        return inference_main(argv[1:])
    return cli.run_command(build_parser, _run, argv)


def _run(args: argparse.Namespace, start: float) -> int:
    """Search, print the report, measure (--empirical), write --json and --write-config; the exit status."""
    cli.check_empirical_budget(args)
    check_output("--json", args.json, args.force)
    check_output("--write-config", args.write_config, args.force)
    if args.json and args.write_config and Path(args.json).resolve() == Path(args.write_config).resolve():
        values = f"--json {args.json}, --write-config {args.write_config}"
        raise ConfigError("--write-config", "names the same file as --json", values, "pass two different paths")
    llama = {name: getattr(args, name) for name in cli.LLAMA_FLAGS}
    model = build_model_shape(args.model, args.layers, args.hidden, args.heads, args.vocab, args.seq_length, **llama)
    cluster = cluster_from_flags(args)
    pinned = {f.name: getattr(args, f.name) for f in dataclasses.fields(Pins)}  # every pin is the flag of its name
    if args.recompute_modules is not None:  # "mlp_act,layernorm"; the names are checked with the other pins
        pinned["recompute_modules"] = tuple(n.strip() for n in args.recompute_modules.split(",") if n.strip())
    pins = Pins(**pinned)
    result = search(model, cluster, args.global_batch_size, pins)
    options = None
    if args.empirical:
        steps, sets = args.empirical_steps, tuple(args.empirical_set)
        options = empirical.EmpiricalOptions(**cli.empirical_settings(args), steps=steps, extra_sets=sets)
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
    emp = cli.run_session(
        options,
        result.winner is not None,
        start,
        lambda deadline, say: empirical.run_empirical(result, options, deadline, say=say),
        lambda emp: format_empirical(emp, result.global_batch_size, result.model.seq_length, top=top),
    )
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
        return cli.EXIT_NO_FIT
    if args.write_config:
        final = emp.winner if emp is not None else None
        command = write_config(result, args.write_config, final.evaluation if final else result.winner, args.force)
        which = "the final (empirical) winner" if final else "the winner"
        print(f"wrote {which} to {args.write_config}; launch it with:\n  {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
