"""``python -m ds_megatron.tune inference``: the best serving layout for a trained model on the GPUs given.

The model is a named size or an explicit shape (the training tuner's flags), an exported transformers directory
(``--hf-dir``) or a ds_megatron checkpoint (``--checkpoint``: its newest complete tag's config).  The report shows the
winner under the latency limits, why it beats the runner-up, and the Pareto front of output tokens/s per GPU against
TPOT and TTFT.  ``--empirical --max-minutes M`` then measures TTFT and TPOT of the top candidates of an exported
model on this machine, refits the model and ranks again.  Exit status: 0 with a winner, 1 when nothing fits or
nothing meets the limits (the closest are listed), 2 on bad input (one ``error:`` line)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from ds_megatron.checkpoint.manifest import newest_complete_tag, tag_config
from ds_megatron.config import ConfigError, ModelShape
from ds_megatron.config.loader import parse_section
from ds_megatron.config.schema import ModelSection
from ds_megatron.config.shape import resolve_shape
from ds_megatron.model import FAMILIES
from ds_megatron.tune.core import cli, session
from ds_megatron.tune.core.cli import FLOAT, INT, check_output, write_output
from ds_megatron.tune.core.memory_model import total_param_count
from ds_megatron.tune.core.spec import FLAGS as SHAPE_FLAGS
from ds_megatron.tune.core.spec import build_model_shape, cluster_from_flags
from ds_megatron.tune.inference.empirical import run_inference_empirical, validate_options
from ds_megatron.tune.inference.empirical_report import format_inference_empirical
from ds_megatron.tune.inference.engines import (
    DEFAULT_ENGINE,
    ENGINES,
    EXPECTED_ERROR,
    INFERENCE_EFFICIENCY,
    inference_cluster,
)
from ds_megatron.tune.inference.model import (
    DEFAULT_BATCH_SIZES,
    KV_PRECISIONS,
    PRECISION_BYTES,
    Workload,
    search_inference,
)
from ds_megatron.tune.inference.probe import InferenceEmpiricalOptions
from ds_megatron.tune.inference.report import format_inference

# The model section's fields the inference model reads off an exported config.json (the family's own keys).
HF_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size")
HF_SHAPE_FIELDS += ("tie_word_embeddings",)
BATCHES = ",".join(map(str, DEFAULT_BATCH_SIZES))
# The command line: argument group -> (flag, add_argument's keywords, help) rows, the model and cluster rows and the
# empirical mode's the core's (the training tuner's).  The efficiency and the overhead default to the engine's
# (tune.inference.engines), not the training model's: None until given.
FLAGS = {
    "model (one of: --model / an explicit shape, --hf-dir, --checkpoint)": (
        *cli.MODEL_FLAGS,
        ("--hf-dir", {"metavar": "DIR"}, "an exported transformers directory (its config.json)"),
        ("--checkpoint", {"metavar": "DIR"}, "a ds_megatron checkpoint directory (--save of a run)"),
    ),
    "cluster": (
        *cli.replaced(
            cli.CLUSTER_FLAGS,
            {
                "--efficiency": (FLOAT, f"fraction of the peak matmuls reach (default {INFERENCE_EFFICIENCY}, fitted)"),
                "--step-overhead-s": (FLOAT, "fixed seconds per forward (default: the --engine preset's)"),
            },
        ),
        (
            "--engine",
            {"choices": list(ENGINES), "default": DEFAULT_ENGINE},
            f"serving engine whose fitted overhead per forward is charged (default {DEFAULT_ENGINE})",
        ),
        (
            "--bandwidth-efficiency",
            FLOAT,
            "fraction of the HBM bandwidth decode's reads reach (default: fitted on published measurements)",
        ),
    ),
    "requests": (
        ("--prompt-length", INT | {"required": True}, "tokens per prompt"),
        ("--output-length", INT | {"required": True}, "tokens generated per request"),
        (
            "--batch-sizes",
            {"default": BATCHES, "metavar": "B1,B2"},
            f"requests served at once per replica, to try (default {BATCHES})",
        ),
        ("--weight-dtype", {"default": "bf16"}, f"weight storage: {', '.join(PRECISION_BYTES)}"),
        ("--kv-dtype", {"default": "bf16"}, f"KV-cache storage: {', '.join(KV_PRECISIONS)}"),
        ("--max-ttft-ms", FLOAT, "limit on the time to first token"),
        ("--max-tpot-ms", FLOAT, "limit on the time per output token"),
    ),
    "output": (
        ("--top", INT | {"default": 10}, "rows of the Pareto table (default 10)"),
        ("--json", {"metavar": "OUT"}, "write every candidate that fits to OUT"),
        ("--force", {"action": "store_true"}, "replace the file of --json if it exists"),
    ),
    "empirical mode (measured TTFT and TPOT of the top candidates on this machine)": cli.empirical_flags(
        "measure the --hf-dir model, refit, rank again",
        top=(6, "candidates to measure, pp 1 only"),
        steps=(3, "measured requests per candidate"),
        warmup=(1, "warm-up requests dropped first"),
        dirs="launch directories (default runs/tune/<date-time>-inference)",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    return cli.build_parser("python -m ds_megatron.tune inference", __doc__.split("\n\n")[0], FLAGS)


def main(argv: list[str] | None = None) -> int:
    return cli.run_command(build_parser, _run, argv)


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(
            "--batch-sizes", "not a list of integers", repr(text), "pass e.g. --batch-sizes 1,8,64"
        ) from None


def hf_model_shape(hf_dir: str, seq_length: int | None) -> ModelShape:
    """The shape of an exported transformers directory of a family ds_megatron trains."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError("--hf-dir", "no config.json", str(hf_dir), "pass a directory written by export")
    try:
        hf = json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(
            "--hf-dir", "config.json is not JSON", f"{path}: {err}", "pass an exported directory"
        ) from None
    family = next((f for f in FAMILIES.values() if f.hf_model_type == hf.get("model_type")), None)
    if family is None:
        types = " or ".join(f.hf_model_type for f in FAMILIES.values())
        raise ConfigError(
            "--hf-dir", "unsupported model_type", repr(hf.get("model_type")), f"pass a {types} model directory"
        )
    keys = {ours: theirs for theirs, ours in family.hf_shape_fields().items()}
    fields = {name: hf[keys[name]] for name in HF_SHAPE_FIELDS if keys.get(name) in hf}
    context = seq_length or hf.get(keys["max_position_embeddings"])
    section = ModelSection(family=family.name, seq_length=context, max_position_embeddings=context, **fields)
    return resolve_shape(section, SHAPE_FLAGS)


def checkpoint_model_shape(save_dir: str, seq_length: int | None) -> ModelShape:
    """The shape a ds_megatron run trained, from its newest complete checkpoint's resolved configuration."""
    tag = newest_complete_tag(save_dir)
    config = tag_config(save_dir, tag) if tag else None
    if config is None:
        raise ConfigError("--checkpoint", "no complete checkpoint with a config", str(save_dir), "pass a run's --save")
    model = parse_section(config.get("ds_megatron")).model
    if seq_length is not None:
        model = ModelSection(**{**vars(model), "seq_length": seq_length, "max_position_embeddings": seq_length})
    return resolve_shape(model)


def model_shape(args: argparse.Namespace) -> ModelShape:
    explicit = args.model is not None or args.layers is not None
    given = (("--model", explicit), ("--hf-dir", args.hf_dir), ("--checkpoint", args.checkpoint))
    sources = [name for name, value in given if value]
    if len(sources) != 1:
        raise ConfigError(
            "--model",
            "one model source needed",
            f"given: {', '.join(sources) or 'none'}",
            "pass one of --model NAME (or an explicit shape), --hf-dir DIR, --checkpoint DIR",
        )
    if args.hf_dir:
        return hf_model_shape(args.hf_dir, args.seq_length)
    if args.checkpoint:
        return checkpoint_model_shape(args.checkpoint, args.seq_length)
    chosen = {name: getattr(args, name) for name in cli.LLAMA_FLAGS}
    return build_model_shape(args.model, args.layers, args.hidden, args.heads, args.vocab, args.seq_length, **chosen)


def _run(args: argparse.Namespace, start: float) -> int:
    cli.check_empirical_budget(args)
    check_output("--json", args.json, args.force)
    model = model_shape(args)
    cluster = inference_cluster(
        cluster_from_flags(args), args.engine, args.efficiency, args.bandwidth_efficiency, args.step_overhead_s
    )
    work = Workload(
        prompt_length=args.prompt_length,
        output_length=args.output_length,
        weight_dtype=args.weight_dtype,
        kv_dtype=args.kv_dtype,
        max_ttft_s=None if args.max_ttft_ms is None else args.max_ttft_ms / 1e3,
        max_tpot_s=None if args.max_tpot_ms is None else args.max_tpot_ms / 1e3,
        batch_sizes=_batch_sizes(args.batch_sizes),
    )
    result = search_inference(model, cluster, work)
    options = None
    if args.empirical:  # refused before the report and before anything is launched
        options = InferenceEmpiricalOptions(**cli.empirical_settings(args), repeats=args.empirical_steps)
        validate_options(result, options, args.hf_dir)
        options = dataclasses.replace(options, device=session.resolve_device(options.device, cluster.num_gpus))
    print(format_inference(result, top=max(1, args.top), engine=args.engine), flush=True)
    emp = cli.run_session(
        options,
        bool(result.evaluations),
        start,
        lambda deadline, say: run_inference_empirical(result, args.hf_dir, options, deadline, say=say),
        lambda emp: format_inference_empirical(emp, top=max(1, args.top)),
    )
    if args.json:
        data = {
            "model": vars(model) | {"parameters": total_param_count(model)},
            "cluster": vars(cluster),
            "workload": vars(work),
            "engine": args.engine,
            "expected_error": {k: {"median": m, "worst": w} for k, (m, w) in EXPECTED_ERROR.items()},
            "winner": result.winner.as_dict() if result.winner else None,
            "pareto_front": [e.as_dict() for e in result.pareto_front()],
            "candidates": [e.as_dict() for e in result.evaluations],
        }
        if emp is not None:
            data["empirical"] = emp.as_dict(top=max(1, args.top))
        write_output("--json", args.json, json.dumps(data, indent=1), args.force)
        print(f"wrote {len(result.evaluations)} candidates to {args.json}")
    if emp is not None:
        return 0 if emp.winner is not None else cli.EXIT_NO_FIT
    return 0 if result.winner else cli.EXIT_NO_FIT
