"""``python -m ds_megatron.tune``: rank training configurations for a GPT or a Llama on a cluster (analytic; seconds,
no GPU).

    python -m ds_megatron.tune --model gpt3-175b --seq-length 2048 --global-batch-size 1536 \\
        --gpus 1024 --gpus-per-node 8 --gpu a100-80gb [--gpu-memory-gb 80 ...] [--json OUT] [--write-config PATH]

``--gpu`` sets the memory, peak, HBM, NVLink and network figures from ds_megatron/tune/gpus.py; each explicit flag
overrides its figure.

With ``--empirical --max-minutes M`` it then trains the top candidates for a few steps on this machine, refits the
time model to the measurements and ranks again (ds_megatron/tune/empirical.py).

Exit status: 0 with a winner, 1 when nothing fits (the reasons are printed), 2 on bad input (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from typing import NoReturn

from ds_megatron.config import ConfigError
from ds_megatron.config.schema import ATTENTION_KERNELS, RECOMPUTE_MODULES, RECOMPUTE_POLICIES
from ds_megatron.config.sizes import FAMILIES, all_size_names
from ds_megatron.tune.empirical import (
    DEVICES,
    EmpiricalOptions,
    EmpiricalResult,
    resolve_device,
    run_empirical,
    validate_options,
)
from ds_megatron.tune.empirical_report import format_empirical
from ds_megatron.tune.gpus import DEFAULT_GPU, GPUS
from ds_megatron.tune.report import format_report
from ds_megatron.tune.search import search
from ds_megatron.tune.spec import (
    DEFAULT_EFFICIENCY,
    INTER_NODE_LATENCY_S,
    INTRA_NODE_LATENCY_S,
    PRESET_FIELDS,
    Pins,
    build_cluster,
    build_model_shape,
)
from ds_megatron.tune.written import to_json, write_config

CPU_KERNEL_NOTE = (
    "empirical on CPU: attention pinned to eager (with dropout on, torch's CPU sdpa falls back to its math path, the "
    "eager kernel's work; pass --attention sdpa to rank sdpa instead)"
)
EXIT_NO_FIT = 1
EXIT_CONFIG_ERROR = 2


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
    g = p.add_argument_group("model")
    g.add_argument("--model", help=f"named size: {', '.join(all_size_names())}")
    g.add_argument("--family", choices=FAMILIES, help="model family of an explicit shape (default gpt2)")
    g.add_argument("--layers", type=int, help="transformer blocks L (overrides --model)")
    g.add_argument("--hidden", type=int, help="hidden size h (overrides --model)")
    g.add_argument("--heads", type=int, help="attention heads a (overrides --model)")
    g.add_argument("--kv-heads", type=int, help="llama: grouped-query attention's KV heads (default: --heads)")
    g.add_argument("--intermediate-size", type=int, help="llama: SwiGLU width F (overrides --model)")
    g.add_argument(
        "--tie-word-embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="llama: output layer tied to the embedding (default: the named size's, else untied)",
    )
    g.add_argument("--vocab", type=int, help="vocabulary size V (default: the named size's, else 50257 or 128256)")
    g.add_argument("--seq-length", type=int, help="sequence length s (default: the named size's, else 2048 or 8192)")
    g.add_argument("--global-batch-size", type=int, required=True, help="sequences per optimizer step")
    g = p.add_argument_group("cluster")
    g.add_argument("--gpus", type=int, required=True, help="total GPUs")
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    g.add_argument(
        "--gpu",
        choices=list(GPUS),
        help=f"GPU preset: memory, peak, HBM, NVLink and network figures (default: {DEFAULT_GPU}'s figures); the "
        "flags below override it",
    )
    g.add_argument("--gpu-memory-gb", type=float, help="memory per GPU in GiB (A100-80GB: 80)")
    g.add_argument("--gpu-peak-tflops", type=float, help="dense bf16 peak per GPU (A100: 312)")
    g.add_argument("--memory-gbps", type=float, help="HBM bandwidth per GPU in GB/s (A100-80GB: 2039)")
    g.add_argument("--intra-node-gbps", type=float, help="NVLink GB/s per GPU, one way (A100: 300)")
    g.add_argument("--inter-node-gbps", type=float, help="network GB/s per GPU, one way (200 Gb/s HDR: 25)")
    g.add_argument(
        "--efficiency",
        type=float,
        default=DEFAULT_EFFICIENCY,
        help=f"ceiling of the matmul-efficiency curve, the fraction of peak a very large GEMM reaches (default "
        f"{DEFAULT_EFFICIENCY}, fitted on published A100 step times; fit yours with --empirical or tune.calibrate)",
    )
    g.add_argument(
        "--intra-node-latency-us",
        type=float,
        default=INTRA_NODE_LATENCY_S * 1e6,
        help=f"fixed cost of a collective or send inside a node (default {INTRA_NODE_LATENCY_S * 1e6:g})",
    )
    g.add_argument(
        "--inter-node-latency-us",
        type=float,
        default=INTER_NODE_LATENCY_S * 1e6,
        help=f"the same across nodes (default {INTER_NODE_LATENCY_S * 1e6:g})",
    )
    g.add_argument(
        "--step-overhead-s",
        type=float,
        default=0.0,
        help="fixed seconds per step outside the model (default 0; --empirical on CPU fits it)",
    )
    g = p.add_argument_group("pins (fix a dimension; the rest is searched)")
    g.add_argument("--tp", type=int, help="tensor-parallel size")
    g.add_argument("--pp", type=int, help="pipeline-parallel size")
    g.add_argument("--dp", type=int, help="data-parallel size")
    g.add_argument("--micro-batch-size", type=int, help="micro-batch size b")
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None, help="SP on or off")
    g.add_argument("--recompute", choices=RECOMPUTE_POLICIES, help="recompute policy")
    g.add_argument(
        "--recompute-modules",
        metavar="A,B",
        help=f"what selective recompute recomputes, from {','.join(RECOMPUTE_MODULES)} (implies --recompute "
        "selective; default: searched per kernel)",
    )
    g.add_argument("--attention", choices=ATTENTION_KERNELS, help="attention kernel (sdpa never with core_attn)")
    g.add_argument("--zero", type=int, choices=(0, 1), help="ZeRO stage")
    g = p.add_argument_group("output")
    g.add_argument("--top", type=int, default=10, help="rows of the ranked table (default 10)")
    g.add_argument("--json", metavar="OUT", help="write every candidate and every rejected family to OUT")
    g.add_argument("--write-config", metavar="PATH", help="write the winner as a ds_configs-style JSON")
    g = p.add_argument_group("empirical mode (short real runs of the top candidates on this machine, then recalibrate)")
    g.add_argument("--empirical", action="store_true", help="measure the top candidates with recipes/train_gpt.py")
    g.add_argument("--max-minutes", type=float, help="wall-clock budget of the whole command (required)")
    g.add_argument("--empirical-top", type=int, default=3, help="candidates to measure (default 3)")
    g.add_argument("--empirical-steps", type=int, default=10, help="measured steps per run (default 10)")
    g.add_argument("--empirical-warmup", type=int, default=3, help="warm-up steps dropped per run (default 3)")
    g.add_argument("--device", choices=DEVICES, default="auto", help="auto: gpu when torch sees CUDA, else cpu")
    g.add_argument("--empirical-dir", metavar="DIR", help="run directories (default runs/tune/<date-time>)")
    g.add_argument(
        "--empirical-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--set for every run, e.g. ds_megatron.data.path=corpus.txt or ds_megatron.data.cache_dir=DIR",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    try:
        args = build_parser().parse_args(argv)
        if args.empirical and args.max_minutes is None:
            raise ConfigError("--max-minutes", "required with --empirical", "not set", "pass e.g. --max-minutes 10")
        model = build_model_shape(
            args.model,
            args.layers,
            args.hidden,
            args.heads,
            args.vocab,
            args.seq_length,
            family=args.family,
            kv_heads=args.kv_heads,
            intermediate_size=args.intermediate_size,
            tie_word_embeddings=args.tie_word_embeddings,
        )
        figures = {name: getattr(args, flag[2:].replace("-", "_")) for name, (_, flag) in PRESET_FIELDS.items()}
        cluster = build_cluster(
            args.gpu,
            args.gpus,
            args.gpus_per_node,
            **figures,  # the --gpu figures the command line overrides
            efficiency=args.efficiency,
            intra_node_latency_s=args.intra_node_latency_us * 1e-6,
            inter_node_latency_s=args.inter_node_latency_us * 1e-6,
            step_overhead_s=args.step_overhead_s,
        )
        pins = Pins(  # every pin is the flag of the same name
            **{f.name: getattr(args, f.name) for f in dataclasses.fields(Pins) if f.name != "recompute_modules"},
            recompute_modules=None if args.recompute_modules is None else _modules(args.recompute_modules),
        )
        result = search(model, cluster, args.global_batch_size, pins)
        options, cpu_note = None, ""
        if args.empirical:
            options = EmpiricalOptions(
                max_minutes=args.max_minutes,
                top=args.empirical_top,
                steps=args.empirical_steps,
                warmup=args.empirical_warmup,
                device=args.device,
                work_dir=args.empirical_dir,
                extra_sets=tuple(args.empirical_set),
            )
            validate_options(result, options)
            options = dataclasses.replace(options, device=resolve_device(options.device, cluster.num_gpus))
            if options.device == "cpu" and pins.attention is None:
                # The CPU runs cannot tell the kernels apart (CPU_KERNEL_NOTE): rank and measure eager, which also
                # allows selective recompute of the attention core.
                result = search(model, cluster, args.global_batch_size, dataclasses.replace(pins, attention="eager"))
                cpu_note = CPU_KERNEL_NOTE
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return EXIT_CONFIG_ERROR
    top = max(1, args.top)
    print(format_report(result, top=top), flush=True)
    if cpu_note:
        print(cpu_note)
    emp: EmpiricalResult | None = None
    if options is not None and result.winner is None:
        print("empirical: skipped, no candidate fits")
    elif options is not None:
        try:
            emp = run_empirical(
                result, options, deadline=start + 60 * args.max_minutes, say=functools.partial(print, flush=True)
            )
        except ConfigError as err:
            print(str(err), file=sys.stderr)
            return EXIT_CONFIG_ERROR
        print(format_empirical(emp, result.global_batch_size, result.model.seq_length, top=top))
    if args.json:
        data = to_json(result)
        if emp is not None:
            data["empirical"] = emp.as_dict(top=top)
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
        print(
            f"wrote {len(result.evaluations)} candidates and {len(result.rejections)} rejected families to {args.json}"
        )
    if result.winner is None:
        if args.write_config:
            print(f"no config written to {args.write_config}: nothing fits", file=sys.stderr)
        return EXIT_NO_FIT
    if args.write_config:
        final = emp.winner if emp is not None else None
        command = write_config(result, args.write_config, final.evaluation if final else result.winner)
        which = "the final (empirical) winner" if final else "the winner"
        print(f"wrote {which} to {args.write_config}; launch it with:\n  {command}")
    return 0


def _modules(text: str) -> tuple[str, ...]:
    """``mlp_act,layernorm`` -> ("mlp_act", "layernorm"); the names are checked with the other pins."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


if __name__ == "__main__":
    sys.exit(main())
