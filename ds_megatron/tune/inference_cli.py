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
import functools
import json
import sys
import time
from pathlib import Path

from ds_megatron.checkpoint.manifest import newest_complete_tag, tag_config
from ds_megatron.config import ConfigError, ModelShape
from ds_megatron.config.loader import parse_section
from ds_megatron.config.numbers import finite_float
from ds_megatron.config.schema import ModelSection
from ds_megatron.config.shape import resolve_shape
from ds_megatron.model import FAMILIES
from ds_megatron.tune.empirical import DEVICES, resolve_device
from ds_megatron.tune.inference import (
    DEFAULT_BATCH_SIZES,
    KV_PRECISIONS,
    PRECISION_BYTES,
    InferenceEvaluation,
    InferenceResult,
    Workload,
    search_inference,
    smallest_fit_note,
)
from ds_megatron.tune.inference_empirical import run_inference_empirical, validate_options
from ds_megatron.tune.inference_empirical_report import format_inference_empirical
from ds_megatron.tune.inference_engines import (
    DEFAULT_ENGINE,
    ENGINES,
    EXPECTED_ERROR,
    INFERENCE_EFFICIENCY,
    expected_error_text,
    inference_cluster,
)
from ds_megatron.tune.inference_probe import InferenceEmpiricalOptions
from ds_megatron.tune.memory_model import GIB, total_param_count
from ds_megatron.tune.spec import FLAGS as SHAPE_FLAGS
from ds_megatron.tune.spec import Cluster, build_model_shape, cluster_from_flags
from ds_megatron.tune.written import check_output, write_output

EXIT_NO_FIT = 1
EXIT_CONFIG_ERROR = 2
TRAINING_ONLY_FLAGS = ("--global-batch-size",)
# The model section's fields the inference model reads off an exported config.json (the family's own keys).
HF_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size")
HF_SHAPE_FIELDS += ("tie_word_embeddings",)
COLUMNS = ("rank", "tp", "pp", "batch", "replicas", "tok/s/GPU", "tok/s all", "TTFT", "TPOT", "memory", "limits")


def build_parser() -> argparse.ArgumentParser:
    from ds_megatron.tune.__main__ import FLAGS, _Parser  # the training tuner's model and cluster flags, shared

    p = _Parser(prog="python -m ds_megatron.tune inference", description=__doc__.split("\n\n")[0])
    model = p.add_argument_group("model (one of: --model / an explicit shape, --hf-dir, --checkpoint)")
    for flag, options, text in FLAGS["model"]:
        if flag not in TRAINING_ONLY_FLAGS:
            model.add_argument(flag, **options, help=text)
    model.add_argument("--hf-dir", metavar="DIR", help="an exported transformers directory (its config.json)")
    model.add_argument("--checkpoint", metavar="DIR", help="a ds_megatron checkpoint directory (--save of a run)")
    cluster = p.add_argument_group("cluster")
    for flag, options, text in FLAGS["cluster"]:
        if flag not in TRAINING_ONLY_FLAGS:
            cluster.add_argument(flag, **options, help=text)
    cluster.add_argument(
        "--engine",
        choices=list(ENGINES),
        default=DEFAULT_ENGINE,
        help=f"serving engine whose fitted overhead per forward is charged (default {DEFAULT_ENGINE})",
    )
    cluster.add_argument(
        "--bandwidth-efficiency",
        type=finite_float,
        help="fraction of the HBM bandwidth decode's reads reach (default: fitted on published measurements)",
    )
    # The inference model's own defaults (tune.inference_engines), not the training model's: None until given.
    p.set_defaults(efficiency=None, step_overhead_s=None)
    for action in p._actions:
        if action.dest == "efficiency":
            action.help = f"fraction of the peak matmuls reach (default {INFERENCE_EFFICIENCY}, fitted)"
        elif action.dest == "step_overhead_s":
            action.help = "fixed seconds per forward (default: the --engine preset's)"
    work = p.add_argument_group("requests")
    work.add_argument("--prompt-length", type=int, required=True, help="tokens per prompt")
    work.add_argument("--output-length", type=int, required=True, help="tokens generated per request")
    work.add_argument(
        "--batch-sizes",
        default=",".join(map(str, DEFAULT_BATCH_SIZES)),
        metavar="B1,B2",
        help=f"requests served at once per replica, to try (default {','.join(map(str, DEFAULT_BATCH_SIZES))})",
    )
    work.add_argument("--weight-dtype", default="bf16", help=f"weight storage: {', '.join(PRECISION_BYTES)}")
    work.add_argument("--kv-dtype", default="bf16", help=f"KV-cache storage: {', '.join(KV_PRECISIONS)}")
    work.add_argument("--max-ttft-ms", type=finite_float, help="limit on the time to first token")
    work.add_argument("--max-tpot-ms", type=finite_float, help="limit on the time per output token")
    out = p.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="rows of the Pareto table (default 10)")
    out.add_argument("--json", metavar="OUT", help="write every candidate that fits to OUT")
    out.add_argument("--force", action="store_true", help="replace the file of --json if it exists")
    emp = p.add_argument_group("empirical mode (measured TTFT and TPOT of the top candidates on this machine)")
    emp.add_argument("--empirical", action="store_true", help="measure the --hf-dir model, refit, rank again")
    emp.add_argument("--max-minutes", type=finite_float, help="wall-clock budget of the whole command (required)")
    emp.add_argument("--empirical-top", type=int, default=6, help="candidates to measure, pp 1 only (default 6)")
    emp.add_argument("--empirical-steps", type=int, default=3, help="measured requests per candidate (default 3)")
    emp.add_argument("--empirical-warmup", type=int, default=1, help="warm-up requests dropped first (default 1)")
    emp.add_argument("--device", choices=DEVICES, default="auto", help="auto: gpu when torch sees CUDA, else cpu")
    emp.add_argument(
        "--empirical-dir", metavar="DIR", help="launch directories (default runs/tune/<date-time>-inference)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    try:
        return _run(build_parser().parse_args(argv), start)
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return EXIT_CONFIG_ERROR


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
    chosen = {name: getattr(args, name) for name in ("family", "kv_heads", "intermediate_size", "tie_word_embeddings")}
    return build_model_shape(args.model, args.layers, args.hidden, args.heads, args.vocab, args.seq_length, **chosen)


def _run(args: argparse.Namespace, start: float) -> int:
    if args.empirical and args.max_minutes is None:
        raise ConfigError("--max-minutes", "required with --empirical", "not set", "pass e.g. --max-minutes 10")
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
        options = InferenceEmpiricalOptions(
            max_minutes=args.max_minutes,
            top=args.empirical_top,
            repeats=args.empirical_steps,
            warmup=args.empirical_warmup,
            device=args.device,
            work_dir=args.empirical_dir,
        )
        validate_options(result, options, args.hf_dir)
        options = dataclasses.replace(options, device=resolve_device(options.device, cluster.num_gpus))
    print(format_inference(result, top=max(1, args.top), engine=args.engine), flush=True)
    emp = None
    if options is not None and not result.evaluations:
        print("empirical: skipped, no candidate fits")
    elif options is not None:
        say = functools.partial(print, flush=True)
        emp = run_inference_empirical(result, args.hf_dir, options, deadline=start + 60 * args.max_minutes, say=say)
        print(format_inference_empirical(emp, top=max(1, args.top)))
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
        return 0 if emp.winner is not None else EXIT_NO_FIT
    return 0 if result.winner else EXIT_NO_FIT


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _row(rank: int, e: InferenceEvaluation) -> list[str]:
    s = e.serving
    return [
        str(rank),
        str(s.tp),
        str(s.pp),
        str(s.batch),
        str(s.replicas),
        f"{e.tokens_per_s_per_gpu:,.0f}",
        f"{e.tokens_per_s:,.0f}",
        ms(e.time.ttft_s),
        ms(e.time.tpot_s),
        f"{e.memory.required_bytes / GIB:.1f} GiB",
        "met" if e.meets_limits else "missed",
    ]


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [list(COLUMNS), *rows]]


def describe(e: InferenceEvaluation) -> str:
    s = e.serving
    return (
        f"tp {s.tp} x pp {s.pp}, batch {s.batch}, {s.replicas} replica{'s' if s.replicas > 1 else ''}: "
        f"{e.tokens_per_s:,.0f} output tokens/s ({e.tokens_per_s_per_gpu:,.0f} per GPU), TTFT {ms(e.time.ttft_s)} "
        f"{expected_error_text('ttft')}, TPOT {ms(e.time.tpot_s)} {expected_error_text('tpot')}, "
        f"{e.memory.required_bytes / GIB:.1f} GiB per GPU"
    )


def why_ahead(a: InferenceEvaluation, b: InferenceEvaluation) -> str:
    """Why the winner ``a`` beats the runner-up ``b``, in the terms that differ."""
    sa, sb = a.serving, b.serving
    parts = [f"{a.tokens_per_s / b.tokens_per_s:.2f}x the output tokens/s of {describe(b)}"]
    if sa.tp != sb.tp:
        parts.append(
            f"tp {sa.tp} vs {sb.tp}: each decode step pays {ms(a.time.decode_tp_comm_s)} vs "
            f"{ms(b.time.decode_tp_comm_s)} of TP all-reduces and reads 1/{sa.tp} vs 1/{sb.tp} of the weights, and "
            f"{sa.replicas} vs {sb.replicas} replicas share the GPUs"
        )
    if sa.batch != sb.batch:
        parts.append(
            f"batch {sa.batch} vs {sb.batch}: a decode step reads the weights once for the whole batch, so a larger "
            "batch yields more tokens per step at a longer TPOT (and more KV cache)"
        )
    if sa.pp != sb.pp:
        parts.append(f"pp {sa.pp} vs {sb.pp}: a batch runs the stages one after the other, so a pipeline adds sends")
    return "; ".join(parts)


def model_line(c: Cluster, engine: str | None) -> str:
    """The constants the prediction rests on and what it is accurate to (docs/tuner.md, "Inference model")."""
    (tm, tw), (pm, pw) = EXPECTED_ERROR["ttft"], EXPECTED_ERROR["tpot"]
    return (
        f"model: {f'engine {engine}, ' if engine else ''}{c.step_overhead_s * 1e3:.2f} ms per forward, matmuls at "
        f"{c.efficiency:.1%} of peak, reads at {c.bandwidth_efficiency:.1%} of HBM; expected error TTFT ±{tm:.0%} "
        f"(worst {tw:.0%}), TPOT ±{pm:.0%} (worst {pw:.0%}), held out by source against published measurements"
    )


def format_inference(result: InferenceResult, top: int = 10, engine: str | None = None) -> str:
    m, c, w = result.model, result.cluster, result.workload
    limits = [f"{name} <= {ms(limit)}" for name, limit in (("TTFT", w.max_ttft_s), ("TPOT", w.max_tpot_s)) if limit]
    lines = [
        f"inference: {m.size or m.family} ({total_param_count(m) / 1e9:.2f}B parameters, {m.num_layers} layers, "
        f"h {m.hidden_size}, {m.num_heads} heads, {m.num_kv_heads} KV heads) on {c.num_gpus} x {c.gpu or 'GPU'} "
        f"({c.gpus_per_node} per node)",
        f"requests: prompt {w.prompt_length}, output {w.output_length} tokens; weights {w.weight_dtype}, KV cache "
        f"{w.kv_dtype}; limits: {', '.join(limits) or 'none'}",
        model_line(c, engine),
    ]
    if not result.evaluations:
        lines.append(f"nothing fits: {smallest_fit_note(m, c, w)}")
        return "\n".join(lines)
    winner = result.winner
    if winner is None:
        lines.append(f"no configuration meets the limits; the closest of {len(result.evaluations)} that fit:")
        lines += _table([_row(i + 1, e) for i, e in enumerate(result.closest())])
        return "\n".join(lines)
    lines.append(f"winner: {describe(winner)}")
    others = [e for e in result.qualifying[1:] if e.serving != winner.serving]
    if others:
        lines.append(f"why: {why_ahead(winner, others[0])}")
    front = result.pareto_front()
    lines.append(
        f"Pareto front (output tokens/s per GPU against TTFT and TPOT): {len(front)} of {len(result.evaluations)} "
        f"candidates that fit, by total output tokens/s"
    )
    lines += _table([_row(i + 1, e) for i, e in enumerate(front[:top])])
    return "\n".join(lines)
