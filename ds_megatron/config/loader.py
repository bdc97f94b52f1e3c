"""Parse and validate a DeepSpeed JSON config with a ``"ds_megatron"`` section.

Every check raises :class:`ConfigError` with one line that names the setting, the values and the fix, before any
process group, file or checkpoint exists (callers validate first, then initialise).  Standard library only.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_megatron.config.context_parallel import (
    check_cp_attention_dropout,
    check_cp_comm,
    check_cp_heads,
    check_cp_seq_length,
)
from ds_megatron.config.ep_rules import (
    EXPERT_TP_SETTING,
    check_dispatch_chunks,
    check_ep,
    check_ep_model,
    check_ep_optimizer,
    check_ep_zero_options,
    check_expert_tp,
    check_num_experts,
    resolved_expert_tp,
)
from ds_megatron.config.ep_rules import SETTING as EP_SETTING
from ds_megatron.config.errors import ConfigError, nearest
from ds_megatron.config.facts import grad_accum_dtype, optimizer_wrapper, precision, zero_stage
from ds_megatron.config.numbers import check_finite_config
from ds_megatron.config.pipeline_checks import check_pipeline_layout, check_schedule_name, check_schedule_run
from ds_megatron.config.rules import (
    CONFIG_FILE_RULES,
    check_batch_split,
    check_core_attn,
    check_tokenizer_fits,
    check_tokenizer_spec,
    check_tp_fits,
    check_valid_fraction,
    check_zero_stage,
)
from ds_megatron.config.schedule import warmup_cosine_from
from ds_megatron.config.schema import (
    BLOCK_LAYER_CLASS,
    DOCUMENT_POSITIONS,
    PIPELINE_SCHEDULES,
    RECOMPUTE_METHODS,
    RECOMPUTE_MODULES,
    RECOMPUTE_POLICIES,
    SP_GRAD_SYNC,
    CheckpointSection,
    DataSection,
    DsMegatronConfig,
    LoggingSection,
    ModelSection,
    ParallelSection,
    PipelineSchedule,
    RecomputeSection,
    TrainSection,
    pipeline_schedule,
)
from ds_megatron.config.shape import ModelShape, layers_per_stage, resolve_shape

SECTION = "ds_megatron"
OPTIMIZER_TYPES = ("adam", "adamw")  # DeepSpeed optimizer types ds_megatron builds (as torch AdamW)


def _build(cls: type, data: Any, path: str) -> Any:
    """Build dataclass ``cls`` from ``data`` strictly: unknown keys and wrong types are errors."""
    if not isinstance(data, dict):
        raise ConfigError(path, "must be a JSON object", f"got {type(data).__name__}", "write it as {...}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            near = nearest(key, list(fields))
            raise ConfigError(
                f"{path}.{key}", "unknown key", f"valid keys: {', '.join(fields)}", f"did you mean '{near}'?"
            )
        f = fields[key]
        if f.name in _NESTED.get(cls.__name__, {}):
            kwargs[key] = _build(_NESTED[cls.__name__][key], value, f"{path}.{key}")
        else:
            kwargs[key] = _check_type(cls, f.name, value, f"{path}.{key}")
    return cls(**kwargs)


_NESTED = {
    "DsMegatronConfig": {
        "model": ModelSection,
        "parallel": ParallelSection,
        "recompute": RecomputeSection,
        "train": TrainSection,
        "data": DataSection,
        "logging": LoggingSection,
        "checkpoint": CheckpointSection,
    }
}

# Expected Python types per field, taken from the dataclass defaults / annotations.
_TYPES = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
    "tuple": (list, tuple),
}


def _check_type(cls: type, name: str, value: Any, path: str) -> Any:
    annotation = str(cls.__annotations__[name])
    base = annotation.split("|")[0].strip().split("[")[0]  # tuple[int, ...] is checked as a tuple (items later)
    if value is None and "None" in annotation:
        return None
    expected = _TYPES.get(base)
    if expected is None:
        return value
    ok = isinstance(value, expected) and not (base in ("int", "float") and isinstance(value, bool))
    if not ok:
        raise ConfigError(path, f"must be {base}", f"got {value!r}", f"set a {base} value")
    if base == "tuple":
        return tuple(value)
    return float(value) if base == "float" else value


def unused_settings(run: RunConfig) -> list[str]:
    """One warning per setting the user gave that nothing reads in this layout (a setting left at its default is
    not named): it is accepted, since a config shared between layouts may carry it, but never silently."""
    raw = run.ds_config.get(SECTION) or {}
    given = {(part, key) for part, body in raw.items() if isinstance(body, dict) for key in body}
    par, data = run.section.parallel, run.section.data
    unused = []
    if par.sequence_parallel and run.tp == 1:
        unused.append(("parallel.sequence_parallel", "with tp 1 there is no TP group to shard over"))
    if ("parallel", "cp_comm") in given and run.cp == 1:
        unused.append(("parallel.cp_comm", f"{par.cp_comm!r} with cp 1: no attention is exchanged between CP ranks"))
    if ("data", "document_positions") in given and not data.document_mask:
        unused.append(
            ("data.document_positions", f"{data.document_positions!r} applies with data.document_mask true only")
        )
    return [f"warning: {SECTION}.{name} does nothing here: {why}" for name, why in unused]


def parse_section(section: dict | None) -> DsMegatronConfig:
    """Strictly parse the ``"ds_megatron"`` section (None means all defaults)."""
    return _build(DsMegatronConfig, section or {}, SECTION)


@dataclass(frozen=True)
class RunConfig:
    """A validated run: the ds_megatron section, the resolved shape, the parallel layout and batch arithmetic."""

    section: DsMegatronConfig
    model: ModelShape
    tp: int
    pp: int
    dp: int  # data-parallel replicas (CP ranks of one replica are not counted: world = tp x cp x pp x dp)
    world_size: int
    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int
    ds_config: dict
    cp: int = 1  # context-parallel ranks per replica (DeepSpeed's data axis holds dp x cp of them)


def _positive(setting: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(setting, "must be a positive integer", f"got {value!r}", "set a positive integer")
    return value


def resolve_batch(ds_config: dict, dp: int) -> tuple[int, int, int]:
    """(micro_batch, grad_accum, global_batch) from DeepSpeed's keys; any two determine the third."""
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    gas = ds_config.get("gradient_accumulation_steps")
    glob = ds_config.get("train_batch_size")
    if micro is None and glob is None:
        raise ConfigError(
            "train_micro_batch_size_per_gpu",
            "no batch size given",
            "neither train_batch_size nor train_micro_batch_size_per_gpu is set",
            "set train_micro_batch_size_per_gpu (and train_batch_size or gradient_accumulation_steps)",
        )
    if micro is not None:
        _positive("train_micro_batch_size_per_gpu", micro)
    if gas is not None:
        _positive("gradient_accumulation_steps", gas)
    if glob is not None:
        _positive("train_batch_size", glob)
    if micro is not None and gas is not None and glob is not None:
        if glob != micro * gas * dp:
            raise ConfigError(
                "train_batch_size",
                "not equal to micro batch x accumulation x dp",
                f"{glob} != {micro} x {gas} x {dp} = {micro * gas * dp}",
                f"set train_batch_size to {micro * gas * dp} or change the other three",
            )
    elif micro is not None and glob is not None:
        check_batch_split(glob, micro, dp, CONFIG_FILE_RULES)
        gas = glob // (micro * dp)
    elif micro is not None:
        gas = gas or 1
        glob = micro * gas * dp
    else:  # glob and maybe gas
        gas = gas or 1
        if glob % (gas * dp) != 0:
            raise ConfigError(
                "train_batch_size",
                "not divisible by accumulation x dp",
                f"{glob} % ({gas} x {dp}) != 0",
                f"set train_batch_size to a multiple of {gas * dp}",
            )
        micro = glob // (gas * dp)
    return micro, gas, glob


def resolve(ds_config: dict, world_size: int) -> RunConfig:
    """Validate a full DeepSpeed config (with our section) for ``world_size`` processes, section by section."""
    check_finite_config(ds_config)
    section = parse_section(ds_config.get(SECTION))
    shape = resolve_shape(section.model)
    tp, pp, cp, dp = check_parallel(section.parallel, shape, world_size)
    schedule = pipeline_schedule(section.parallel.pipeline_schedule)  # a known name: check_parallel refused others
    schedule = schedule.for_settings(section.parallel)  # at the run's stages per rank (checked by check_parallel)
    check_recompute(section.recompute, shape, pp, schedule, section.parallel)
    check_deepspeed_keys(ds_config, pp)
    check_train(section.train)
    check_eval_only(section)
    check_counts(section)
    check_ep_run(section, ds_config)  # what expert parallelism does not train with yet
    # data.tokenizer and data.valid_fraction apply to text tokenised in the launch only: pre-flight checks them
    # (check_text_settings) once it knows the data is not a prepared directory, which brings its own.
    check_data_section(section.data)
    micro, gas, glob = resolve_batch(ds_config, dp)
    check_schedule_run(schedule, ds_config, tp, pp, gas)
    # The resolved batch arithmetic is written back, so the config saved with a checkpoint states its layout
    # (``facts.saved_layout`` reads dp from it) even when the file gave only two of the three numbers.
    batch = {"train_batch_size": glob, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}
    return RunConfig(section, shape, tp, pp, dp, world_size, micro, gas, glob, {**ds_config, **batch}, cp=cp)


def check_parallel(par: ParallelSection, shape: ModelShape, world_size: int) -> tuple[int, int, int, int]:
    """(tp, pp, cp, dp): sizes that split the shape and the world size."""
    tp = _positive("ds_megatron.parallel.tp", par.tp)
    pp = _positive("ds_megatron.parallel.pp", par.pp)
    _positive("ds_megatron.parallel.vocab_multiple", par.vocab_multiple)
    check_tp_fits(shape, tp, CONFIG_FILE_RULES)
    schedule = check_schedule_name(par.pipeline_schedule, pp, par)
    # A layout of its own may leave the first and last stages without blocks; otherwise each stage needs one.
    layout = check_pipeline_layout(par, shape.num_layers, pp, schedule)
    if layout is None and shape.num_layers < pp * schedule.per_rank(par):
        per_rank = schedule.per_rank(par)
        largest_pp = shape.num_layers // per_rank
        # A schedule that needs a pipeline refuses pp 1 (check_schedule_name): never suggest a pp it refuses.
        if largest_pp >= (1 if schedule.pipeline_reason is None else 2):
            fix = f"set pp <= {largest_pp}"
        else:
            fix = (
                f"use at least {2 * per_rank} layers for {schedule.name}, or "
                f'pipeline_schedule "{PIPELINE_SCHEDULES[0].name}" with pp <= {shape.num_layers}'
            )
        raise ConfigError(
            "ds_megatron.parallel.pp",
            "fewer layers than pipeline stages",
            f"num_layers={shape.num_layers}, pp={pp}"
            + (f", {schedule.name}: {per_rank} stages per rank" if per_rank > 1 else ""),
            fix,
        )
    cp = _positive("ds_megatron.parallel.cp", par.cp)
    check_cp_comm(par.cp_comm)
    if world_size % (tp * cp * pp) != 0:
        axes = ("tp", "cp", "pp") if cp > 1 else ("tp", "pp")  # cp named only where it is set
        sizes = {"tp": tp, "cp": cp, "pp": pp}
        raise ConfigError(
            "ds_megatron.parallel",
            f"{' x '.join(axes)} does not divide the world size",
            f"{' x '.join(f'{a}({sizes[a]})' for a in axes)} = {tp * cp * pp}, world size {world_size}",
            f"launch a multiple of {tp * cp * pp} processes or change {'/'.join(axes)}",
        )
    dp = world_size // (tp * cp * pp)
    check_cp_seq_length(shape.seq_length, cp, tp, par.sequence_parallel)
    if par.cp_comm == "a2a":
        check_cp_heads(shape.num_heads, shape.num_kv_heads, tp, cp)
    check_cp_attention_dropout(cp, shape.dropout)
    if par.sequence_parallel and tp > 1 and shape.seq_length % tp != 0:
        raise ConfigError(
            "ds_megatron.parallel.sequence_parallel",
            "seq_length not divisible by tp",
            f"seq_length={shape.seq_length}, tp={tp}",
            "choose seq_length as a multiple of tp or turn sequence_parallel off",
        )
    if par.sp_grad_sync not in SP_GRAD_SYNC:
        raise ConfigError(
            "ds_megatron.parallel.sp_grad_sync",
            "unknown mode",
            f"got {par.sp_grad_sync!r}",
            f"use one of {SP_GRAD_SYNC}",
        )
    check_partition_method(par.partition_method)
    check_expert_parallel(par, shape, tp, cp, dp)
    return tp, pp, cp, dp


def check_recompute(
    rc: RecomputeSection, shape: ModelShape, pp: int, schedule: PipelineSchedule, par: ParallelSection | None = None
) -> None:
    """A known policy and method; modules known, once each, for selective only, and worth recomputing."""
    if rc.policy not in RECOMPUTE_POLICIES:
        raise ConfigError(
            "ds_megatron.recompute.policy", "unknown policy", f"got {rc.policy!r}", f"use one of {RECOMPUTE_POLICIES}"
        )
    if rc.method not in RECOMPUTE_METHODS:
        raise ConfigError(
            "ds_megatron.recompute.method", "unknown method", f"got {rc.method!r}", f"use one of {RECOMPUTE_METHODS}"
        )
    unknown = [m for m in rc.modules if m not in RECOMPUTE_MODULES]
    if unknown or len(set(rc.modules)) != len(rc.modules):
        raise ConfigError(
            "ds_megatron.recompute.modules",
            "unknown or repeated module",
            f"got {list(rc.modules)}",
            f"list each at most once from {list(RECOMPUTE_MODULES)}",
        )
    if rc.modules and rc.policy != "selective":
        raise ConfigError(
            "ds_megatron.recompute.modules",
            "applies to policy selective only",
            f"policy={rc.policy!r}, modules={list(rc.modules)}",
            'set policy "selective" or remove modules',
        )
    if "moe" in rc.selective_modules and not shape.num_experts:
        raise ConfigError(
            "ds_megatron.recompute.modules",
            "moe recomputes the routed experts' activations, and this model has none",
            f"modules={list(rc.modules)}, family={shape.family}",
            "remove moe (it applies to the mixture-of-experts families)",
        )
    check_core_attn(shape.attention, rc.selective_modules, CONFIG_FILE_RULES, defaulted=not rc.modules)
    if rc.policy == "full":
        _positive("ds_megatron.recompute.num_layers", rc.num_layers)
        per_rank = schedule.per_rank(par)
        stages = pp * per_rank
        layout = par.pipeline_layout if par is not None else None
        per_stage = max(layout) if layout else layers_per_stage(shape.num_layers, stages)
        if rc.num_layers > per_stage:
            split = f"pp {pp}" if stages == pp else f"{stages} stages ({schedule.name}: {per_rank} per rank)"
            raise ConfigError(
                "ds_megatron.recompute.num_layers",
                "more recomputed layers than a pipeline stage holds",
                f"num_layers={rc.num_layers}, {shape.num_layers} layers / {split} = at most {per_stage} per stage"
                if not layout
                else f"num_layers={rc.num_layers}, pipeline_layout={list(layout)}: at most {per_stage} per stage",
                f"set recompute.num_layers <= {per_stage}",
            )


def check_deepspeed_keys(ds_config: dict, pp: int) -> None:
    """DeepSpeed's own keys that ds_megatron runs under: ZeRO stage, precision, gradient accumulation dtype, no
    DeepSpeed recomputation, the optimizer, its learning rate and schedule."""
    check_zero_stage(zero_stage(ds_config), pp, CONFIG_FILE_RULES)
    if (ds_config.get("bf16") or {}).get("enabled") and (ds_config.get("fp16") or {}).get("enabled"):
        raise ConfigError("bf16.enabled", "bf16 and fp16 both enabled", "bf16=true, fp16=true", "enable only one")
    check_grad_accum_dtype(ds_config)
    interval = (ds_config.get("pipeline") or {}).get("activation_checkpoint_interval")
    if ds_config.get("activation_checkpointing") or interval:
        key = (
            "activation_checkpointing"
            if ds_config.get("activation_checkpointing")
            else "pipeline.activation_checkpoint_interval"
        )
        raise ConfigError(
            key,
            "ds_megatron would ignore it: recomputation is ds_megatron.recompute's (DeepSpeed's assumes "
            "activations replicated over TP, wrong under SP)",
            f"{key} is set",
            'remove it and set ds_megatron.recompute (e.g. {"policy": "selective"} or {"policy": "full"})',
        )
    kind = str((ds_config.get("optimizer") or {}).get("type", "AdamW"))
    if kind.lower() not in OPTIMIZER_TYPES:
        raise ConfigError(
            "optimizer.type",
            "ds_megatron builds torch AdamW from this section and supports no other optimizer",
            f"got {kind!r}",
            'set "type": "AdamW" (or "Adam")',
        )
    lr = ((ds_config.get("optimizer") or {}).get("params") or {}).get("lr", 1e-3)
    if not isinstance(lr, (int, float)) or lr <= 0:
        raise ConfigError("optimizer.params.lr", "must be a positive number", f"got {lr!r}", "set e.g. 6e-4")
    warmup_cosine_from(ds_config)  # validates the scheduler section ds_megatron implements


def check_train(train: TrainSection) -> None:
    if train.train_iters == 0 and not train.eval_only:
        raise ConfigError(
            "ds_megatron.train.train_iters",
            "must be a positive integer",
            "got 0",
            "set a positive integer, or pass --eval-only to evaluate a checkpoint without training",
        )
    for name in ("log_interval", "eval_iters", "sample_top_k") + (() if train.eval_only else ("train_iters",)):
        _positive(f"ds_megatron.train.{name}", getattr(train, name))
    if not (0.0 < train.sample_temperature < float("inf")):
        raise ConfigError(
            "ds_megatron.train.sample_temperature",
            "must be a positive number",
            f"got {train.sample_temperature!r}",
            "set e.g. 0.8",
        )


def check_eval_only(section: DsMegatronConfig) -> None:
    """An evaluation-only run reports the validation loss of weights it loads: without any, there is nothing to
    evaluate."""
    ck = section.checkpoint
    if section.train.eval_only and not (ck.load or ck.init_from_hf):
        raise ConfigError(
            "ds_megatron.train.eval_only",
            "nothing to evaluate: no checkpoint or transformers model is loaded",
            "checkpoint.load and checkpoint.init_from_hf unset",
            "pass --load DIR (a checkpoint) or --init-from-hf DIR (a transformers model)",
        )


# Counts where 0 has a meaning and a negative number none, with that meaning for the fix.  A negative seed would
# pass the model's initialisation and fail in the data order's generator, after every process group exists.
NON_NEGATIVE = {
    "train.seed": "e.g. 1234",
    "train.eval_interval": "0 validates at the end only",
    "train.max_bad_steps": "0 stops at the first non-finite step",
    "train.generate_tokens": "0 prints no sample",
    "checkpoint.save_interval": "0 saves at the end only",
    "checkpoint.keep_last": "0 keeps every checkpoint",
}
WANDB_MODES = ("online", "offline", "disabled")


def check_ep_run(section: DsMegatronConfig, ds_config: dict) -> None:
    """What expert parallelism does not train with yet, refused in one line: DeepSpeed's fp16 optimizer, fp16 on its
    ZeRO optimizer and the ZeRO optimizer's options its expert handling lacks (``config.ep_rules``: why).
    Checkpoints are written as an ep 1 run holds them on every optimizer that trains (``checkpoint/ep_state.py``:
    the fp32 one's per-parameter state, the BF16 and ZeRO optimizers' flat partitions); ``moe`` selective
    recompute re-runs the local experts."""
    ep = section.parallel.ep
    if ep == 1:
        return
    wrapper, zero = optimizer_wrapper(ds_config), ds_config.get("zero_optimization") or {}
    check_ep_optimizer(ep, wrapper, zero_stage(ds_config), grad_accum_dtype(ds_config), precision(ds_config))
    offload = (zero.get("offload_optimizer") or {}).get("device")
    elastic = bool(zero.get("elastic_checkpoint", False))
    check_ep_zero_options(ep, wrapper, bool(zero.get("reduce_scatter", True)), offload, elastic)


def check_expert_parallel(par: ParallelSection, shape: ModelShape, tp: int, cp: int, dp: int) -> None:
    """ep > 1 needs routed experts, an even split of them, and a layout the folding can form; the overlapped exchange
    needs ep > 1 and at most num_experts / ep chunks (``config.ep_rules``)."""
    ep = _positive(EP_SETTING, par.ep)
    if par.expert_tp is not None:
        check_expert_tp(_positive(EXPERT_TP_SETTING, par.expert_tp), ep, tp)
    if ep > 1:
        check_ep_model(ep, shape.num_experts, shape.family)
        # the folding's rule first: its valid values are those that also split the experts evenly
        check_ep(ep, tp, cp, dp, par.sequence_parallel, shape.num_experts, resolved_expert_tp(par.expert_tp, ep, tp))
        check_num_experts(shape.num_experts, ep)
    check_dispatch_chunks(par.ep_dispatch_chunks, ep, shape.num_experts)


def check_partition_method(method: str) -> None:
    """DeepSpeed's ``type:<regex>`` partitioning balances the layers whose class name the regex matches; one that
    matches no block balances nothing (the stages are then cut without regard to the blocks)."""
    if not method.lower().startswith("type:"):
        return
    pattern = method.split(":", 1)[1]
    try:
        matches = re.search(pattern, BLOCK_LAYER_CLASS, re.IGNORECASE)
    except re.error as err:
        raise ConfigError(
            "ds_megatron.parallel.partition_method", "not a regular expression", f"{method!r}: {err}", "fix the pattern"
        ) from None
    if not matches:
        raise ConfigError(
            "ds_megatron.parallel.partition_method",
            "the pattern matches no transformer block of the pipeline",
            f"partition_method={method!r}, the block layer's class is {BLOCK_LAYER_CLASS}",
            f"write type:{BLOCK_LAYER_CLASS} (the default) or uniform",
        )


def check_counts(section: DsMegatronConfig) -> None:
    """The counts and switches of the train, data, checkpoint and logging sections that no type check catches."""
    for path, meaning in NON_NEGATIVE.items():
        part, name = path.split(".")
        value = getattr(getattr(section, part), name)
        if value < 0:
            raise ConfigError(
                f"ds_megatron.{path}", "must not be negative", f"got {value}", f"set 0 or more ({meaning})"
            )
    _positive("ds_megatron.data.num_proc", section.data.num_proc)
    if not section.data.text_field:
        raise ConfigError("ds_megatron.data.text_field", "empty", "got ''", 'name the field holding text, e.g. "text"')
    log = section.logging
    if log.wandb_mode is not None and log.wandb_mode not in WANDB_MODES:
        raise ConfigError(
            "ds_megatron.logging.wandb_mode", "unknown mode", f"got {log.wandb_mode!r}", f"use one of {WANDB_MODES}"
        )
    if log.peak_tflops is not None and not 0 < log.peak_tflops < float("inf"):
        raise ConfigError(
            "ds_megatron.logging.peak_tflops", "must be positive", f"got {log.peak_tflops}", "set e.g. 989 (H100 bf16)"
        )


def check_data_section(data: DataSection) -> None:
    """``max_inlaunch_bytes`` positive; ``hf_config`` only with a Hugging Face dataset name in ``path``; ``blend`` a
    list of [directory, weight] with weights >= 0, not all zero, and not together with ``path``."""
    _positive("ds_megatron.data.max_inlaunch_bytes", data.max_inlaunch_bytes)
    if data.document_positions not in DOCUMENT_POSITIONS:
        raise ConfigError(
            "ds_megatron.data.document_positions",
            "unknown positions",
            f"got {data.document_positions!r}",
            f"use one of {DOCUMENT_POSITIONS}",
        )
    check_hf_config(data)
    if not data.blend:
        return
    setting = "ds_megatron.data.blend"
    example = 'write e.g. [["a.prepared", 0.7], ["b.prepared", 0.3]]'
    for i, entry in enumerate(data.blend):
        ok = isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)
        if not ok or not isinstance(entry[1], (int, float)) or isinstance(entry[1], bool):
            raise ConfigError(setting, f"entry {i} is not [prepared directory, weight]", f"got {entry!r}", example)
        if not entry[1] >= 0 or entry[1] == float("inf"):
            raise ConfigError(
                setting,
                "weights must be finite and >= 0",
                f"{entry[0]}: {entry[1]}",
                "give every directory a weight >= 0",
            )
    if sum(float(entry[1]) for entry in data.blend) <= 0:
        weights = ", ".join(f"{entry[0]}: {entry[1]}" for entry in data.blend)
        raise ConfigError(setting, "all weights are zero", weights, "give at least one directory a positive weight")
    if data.path is not None:
        raise ConfigError(
            setting, "set together with data.path", f"path={data.path!r}", "use either data.blend or data.path (--data)"
        )


def check_hf_config(data: DataSection) -> None:
    """A configuration name belongs to a Hugging Face dataset: refused with a blend or the built-in corpus here, with
    local files or a prepared directory in pre-flight (which can look at files); nothing would read it."""
    if data.hf_config is not None and (data.blend or data.path is None):
        raise hf_config_unused(data)


def hf_config_unused(data: DataSection) -> ConfigError:
    where = f"blend={list(data.blend)!r}" if data.blend else f"path={data.path!r}"
    return ConfigError(
        "ds_megatron.data.hf_config",
        "a configuration name needs a Hugging Face dataset name in data.path",
        f"hf_config={data.hf_config!r}, {where}",
        "remove data.hf_config, or set data.path to the dataset's name (e.g. wikitext)",
    )


def effective_tokenizer(run: RunConfig) -> str:
    """The tokenizer spec a run uses: the configured one, else a byte-level BPE of the model's vocabulary size."""
    return run.section.data.tokenizer or f"bpe:{run.model.vocab_size}"


def check_text_settings(run: RunConfig) -> None:
    """The settings of text tokenised in the launch (the built-in corpus, local files, a Hugging Face dataset): the
    tokenizer spec fits the model and ``valid_fraction`` is in (0, 0.5).  A prepared directory or a blend brings its
    own tokenizer and validation split and ignores both, so pre-flight calls this for raw text only."""
    check_tokenizer(effective_tokenizer(run), run.model.vocab_size)
    check_valid_fraction(run.section.data.valid_fraction, CONFIG_FILE_RULES)


def check_grad_accum_dtype(ds_config: dict) -> None:
    """DeepSpeed accumulates gradients in a dtype other than the model's only through a ZeRO optimizer; at ZeRO 0
    it stops inside ``deepspeed.initialize`` on every rank (``NotImplementedError: unsupported mix``)."""
    prec, accum, stage = precision(ds_config), grad_accum_dtype(ds_config), zero_stage(ds_config)
    if accum not in ("fp32", "bf16", "fp16"):
        raise ConfigError(
            "data_types.grad_accum_dtype", "unknown dtype", f"got {accum!r}", 'use "fp32", "bf16" or "fp16"'
        )
    if stage == 0 and accum != prec:
        raise ConfigError(
            "data_types.grad_accum_dtype",
            "gradients accumulate in another dtype than the model's only with ZeRO stage 1",
            f"grad_accum_dtype={accum}, model {prec}, zero_optimization.stage=0",
            "set zero_optimization.stage to 1, or remove data_types.grad_accum_dtype",
        )


def check_tokenizer(spec: str, vocab_size: int) -> None:
    """``bpe:N`` must fit the model's vocabulary; a directory must exist (its size is checked once loaded)."""
    check_tokenizer_spec(spec, CONFIG_FILE_RULES)
    if spec.startswith("bpe:"):
        check_tokenizer_fits(int(spec.removeprefix("bpe:")), spec, vocab_size, CONFIG_FILE_RULES)


def load_json(path: str | Path) -> dict:
    """Read a JSON config; a syntax error names the line and column."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("--deepspeed_config", "file not found", str(p), "pass an existing JSON file")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(
            "--deepspeed_config",
            "invalid JSON",
            f"{p}: line {e.lineno} column {e.colno}: {e.msg}",
            "fix the JSON syntax",
        ) from None
