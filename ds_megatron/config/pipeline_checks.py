"""Pre-launch checks of ``ds_megatron.parallel.pipeline_schedule`` (standard library only): what each schedule needs
of the layout, the batch and the rest of the config, refused in one line before any process exists."""

from __future__ import annotations

from ds_megatron.config.errors import ConfigError
from ds_megatron.config.facts import precision
from ds_megatron.config.schema import PIPELINE_SCHEDULES, PipelineSchedule, pipeline_schedule

SETTING = "ds_megatron.parallel.pipeline_schedule"
VIRTUAL_STAGES = "ds_megatron.parallel.virtual_stages"


def check_schedule_name(name: str, pp: int, virtual_stages: int | None = None) -> PipelineSchedule:
    """The schedule called ``name`` (with ``virtual_stages`` per rank where it has them); refused when unknown,
    other than 1F1B without a pipeline, or given virtual stages it does not have or fewer than 2."""
    names = [s.name for s in PIPELINE_SCHEDULES]
    if name not in names:
        raise ConfigError(SETTING, "unknown schedule", f"got {name!r}", f"use one of {names}")
    if name != PIPELINE_SCHEDULES[0].name and pp == 1:
        raise ConfigError(
            SETTING,
            "schedules other than 1f1b reorder pipeline stages, and pp 1 has one stage",
            f"pipeline_schedule={name!r}, pp=1",
            f'set pp >= 2 or pipeline_schedule "{PIPELINE_SCHEDULES[0].name}"',
        )
    schedule = pipeline_schedule(name)
    virtual = [s.name for s in PIPELINE_SCHEDULES if s.virtual]
    if virtual_stages is not None and not schedule.virtual:
        raise ConfigError(
            VIRTUAL_STAGES,
            "only a schedule with virtual stages reads it",
            f"virtual_stages={virtual_stages!r}, pipeline_schedule={name!r}",
            f"remove it, or set pipeline_schedule to one of {virtual}",
        )
    if virtual_stages is not None and (type(virtual_stages) is not int or virtual_stages < 2):
        raise ConfigError(
            VIRTUAL_STAGES,
            "model chunks per pipeline rank must be an integer >= 2 (one chunk per rank is 1f1b)",
            f"virtual_stages={virtual_stages!r}",
            f'set virtual_stages >= 2, or pipeline_schedule "{PIPELINE_SCHEDULES[0].name}"',
        )
    return pipeline_schedule(name, virtual_stages)


def check_schedule_run(schedule: PipelineSchedule, ds_config: dict, tp: int, pp: int, grad_accum: int) -> None:
    """What DeepSpeed's engine for ``schedule`` cannot run (checked on deepspeed 0.19.8's DualPipeVEngine)."""
    if schedule.virtual:
        check_interleaved_run(schedule, ds_config, tp, pp, grad_accum)
        return
    need = schedule.micro_batches_per_rank * pp
    if grad_accum < need:
        raise ConfigError(
            "gradient_accumulation_steps",
            f"the {schedule.name} schedule needs at least {schedule.micro_batches_per_rank} x pp micro-batches per "
            "step (it fills the pipeline from both ends)",
            f"gradient_accumulation_steps={grad_accum}, pp={pp}, pipeline_schedule={schedule.name!r}",
            f"set gradient_accumulation_steps >= {need} (raise train_batch_size or lower the micro-batch size)",
        )
    if schedule.name == PIPELINE_SCHEDULES[0].name:
        return
    if schedule.stages_per_rank == 1:  # zb-h1, zb-h2: DeepSpeed's own engine, deferred weight gradients
        if precision(ds_config) == "fp16":
            # fp16's wrappers scale and accumulate 16-bit gradients in backward; deferred weight gradients bypass that
            raise ConfigError(
                SETTING,
                f"{schedule.name} is not supported with fp16",
                f"pipeline_schedule={schedule.name!r}, fp16.enabled=true",
                f'use bf16 or fp32, or pipeline_schedule "{PIPELINE_SCHEDULES[0].name}"',
            )
        return
    pipe = ds_config.get("pipeline") or {}
    for key in ("pipe_partitioned", "grad_partitioned"):
        if tp > 1 and pipe.get(key):
            raise ConfigError(
                f"pipeline.{key}",
                f"DeepSpeed's {schedule.name} engine sends whole stage-boundary tensors (no TP partitioning)",
                f"{key}=true, tp={tp}, pipeline_schedule={schedule.name!r}",
                f"remove pipeline.{key} (ds_megatron turns it off)",
            )
    if pipe.get("dynamic_shape"):
        raise ConfigError(
            "pipeline.dynamic_shape",
            f"DeepSpeed's {schedule.name} engine exchanges the boundary tensors' shapes once",
            f"dynamic_shape=true, pipeline_schedule={schedule.name!r}",
            "remove pipeline.dynamic_shape (ds_megatron's boundary tensors have fixed shapes)",
        )
    if precision(ds_config) == "fp16":
        # Measured on deepspeed 0.19.8, tiny GPT-2 at pp 2: the third step's gradient norm was 1.647 under
        # DualPipeV and 1.832 under 1F1B with the same weights and data (bf16 and fp32 agree to the last digit):
        # the fp16 wrapper's loss scaling meets the two phases' backward passes in a way DeepSpeed does not test.
        raise ConfigError(
            "fp16.enabled",
            f"fp16 under the {schedule.name} schedule gives other gradients than 1f1b (its loss scaling is not "
            "verified with two stages per rank)",
            f"fp16=true, pipeline_schedule={schedule.name!r}",
            'use bf16 (with "data_types": {"grad_accum_dtype": "fp32"}) or pipeline_schedule "1f1b"',
        )


def check_interleaved_run(schedule: PipelineSchedule, ds_config: dict, tp: int, pp: int, grad_accum: int) -> None:
    """What interleaved 1F1B cannot run: micro-batches per step that are not a multiple of pp (the order walks them
    through each chunk in groups of pp), fp16 (its loss scaling is not verified with several chunks per rank), and
    the boundary settings DeepSpeed's DualPipeV instructions, which its engine reuses, do not support."""
    if grad_accum % pp:
        valid = [pp * k for k in range(1, 5)]
        raise ConfigError(
            "gradient_accumulation_steps",
            f"the {schedule.name} schedule needs a multiple of pp micro-batches per step",
            f"gradient_accumulation_steps={grad_accum}, pp={pp}, pipeline_schedule={schedule.name!r}",
            f"use one of {valid}, ... (set train_batch_size or the micro-batch size to match)",
        )
    if precision(ds_config) == "fp16":
        raise ConfigError(
            "fp16.enabled",
            f"fp16 loss scaling is not verified under {schedule.name}",
            f"fp16=true, pipeline_schedule={schedule.name!r}",
            f'use bf16 or fp32, or pipeline_schedule "{PIPELINE_SCHEDULES[0].name}"',
        )
    pipe = ds_config.get("pipeline") or {}
    for key in ("pipe_partitioned", "grad_partitioned"):
        if tp > 1 and pipe.get(key):
            raise ConfigError(
                f"pipeline.{key}",
                f"the {schedule.name} engine sends whole stage-boundary tensors (no TP partitioning)",
                f"{key}=true, tp={tp}, pipeline_schedule={schedule.name!r}",
                f"remove pipeline.{key} (ds_megatron turns it off)",
            )
    if pipe.get("dynamic_shape"):
        raise ConfigError(
            "pipeline.dynamic_shape",
            f"the {schedule.name} engine exchanges each chunk's boundary shape once",
            f"dynamic_shape=true, pipeline_schedule={schedule.name!r}",
            "remove pipeline.dynamic_shape (ds_megatron's boundary tensors have fixed shapes)",
        )
