"""Pre-launch checks of ``ds_megatron.parallel.pipeline_schedule`` (standard library only): what each schedule needs
of the layout, the batch and the rest of the config (its record's refusals, ``pipeline_parallel.schedules``), refused
in one line before any process exists."""

from __future__ import annotations

from typing import Any

from ds_megatron.config.errors import ConfigError
from ds_megatron.config.facts import precision
from ds_megatron.config.schema import DEFAULT_PARTITION_METHOD
from ds_megatron.pipeline_parallel.schedules import DEFAULT, SCHEDULES, RunFacts, Schedule, schedule_named
from ds_megatron.pipeline_parallel.schedules.record import SETTING, stages_setting_refusal


def check_schedule_name(name: str, pp: int, par: Any = None) -> Schedule:
    """The schedule called ``name`` at the stages per rank ``par`` (the run's ``ParallelSection``) chooses for it;
    refused when unknown, when it needs a pipeline and pp is 1, or when a stages-per-rank setting is given to a
    schedule that does not read it or is not an integer >= 2."""
    names = [s.name for s in SCHEDULES]
    if name not in names:
        raise ConfigError(SETTING, "unknown schedule", f"got {name!r}", f"use one of {names}")
    schedule = schedule_named(name)
    if schedule.pipeline_reason is not None and pp == 1:
        raise ConfigError(
            SETTING,
            f"schedules other than {DEFAULT.name} reorder pipeline stages, and pp 1 has one stage",
            f"pipeline_schedule={name!r}, pp=1",
            f'set pp >= 2 or pipeline_schedule "{DEFAULT.name}"',
        )
    settings = {s.stages_setting for s in SCHEDULES if s.stages_setting is not None}
    for setting in sorted(settings):
        readers = [s.name for s in SCHEDULES if s.stages_setting == setting]
        refusal = stages_setting_refusal(schedule, setting, getattr(par, setting, None), readers)
        if refusal is not None:
            raise ConfigError(*refusal)
    return schedule.for_settings(par)


def check_schedule_run(schedule: Schedule, ds_config: dict, tp: int, pp: int, grad_accum: int) -> None:
    """What the engine of ``schedule`` cannot run: the record's own refusals, then too few micro-batches (a
    record's refusal says it in its own terms first: interleaving's multiple of pp)."""
    facts = RunFacts(tp, pp, grad_accum, precision(ds_config), ds_config.get("pipeline") or {}, DEFAULT.name)
    refusal = schedule.refuse(facts)
    if refusal is not None:
        raise ConfigError(*refusal)
    need = schedule.micro_batches_per_rank * pp
    if grad_accum < need:
        raise ConfigError(
            "gradient_accumulation_steps",
            f"the {schedule.name} schedule needs at least {schedule.micro_batches_per_rank} x pp micro-batches per "
            "step (it fills the pipeline from both ends)",
            f"gradient_accumulation_steps={grad_accum}, pp={pp}, pipeline_schedule={schedule.name!r}",
            f"set gradient_accumulation_steps >= {need} (raise train_batch_size or lower the micro-batch size)",
        )


LAYOUT_SETTING = "ds_megatron.parallel.pipeline_layout"


def check_pipeline_layout(par: Any, num_layers: int, pp: int, schedule: Schedule) -> tuple[int, ...] | None:
    """The blocks per pipeline stage ``par.pipeline_layout`` gives (None: partition_method's balanced split), in
    model-chunk order: one entry per stage, pp x the schedule's stages per rank, integers summing to num_layers.
    The first stage also holds the embedding and the last the final norm, output layer and loss, so only they may
    hold no block; a stage between them with none would pass its input on unchanged, costing a hop for nothing."""
    layout = par.pipeline_layout
    if layout is None:
        return None
    given = f"pipeline_layout={list(layout)}"
    per_rank = schedule.per_rank(par)
    stages = pp * per_rank
    balanced = [num_layers // stages + (s < num_layers % stages) for s in range(stages)]
    if any(not isinstance(n, int) or isinstance(n, bool) for n in layout):
        raise ConfigError(LAYOUT_SETTING, "block counts must be integers", given, f"write e.g. {balanced}")
    if par.partition_method != DEFAULT_PARTITION_METHOD:
        raise ConfigError(
            LAYOUT_SETTING,
            "pipeline_layout sets the stages' blocks itself, so a partition_method would be ignored",
            f"{given}, partition_method={par.partition_method!r}",
            "remove one of the two",
        )
    if len(layout) != stages:
        why = f"pp {pp}" if per_rank == 1 else f"pp {pp} x {per_rank} stages per rank of {schedule.name}"
        raise ConfigError(
            LAYOUT_SETTING,
            "one block count per pipeline stage, in model order",
            f"{given} has {len(layout)} entries; {why} = {stages} stages",
            f"give {stages} counts summing to {num_layers}, e.g. {balanced}",
        )
    negative = [n for n in layout if n < 0]
    if negative:
        raise ConfigError(LAYOUT_SETTING, "a block count is negative", given, f"use counts >= 0, e.g. {balanced}")
    if sum(layout) != num_layers:
        raise ConfigError(
            LAYOUT_SETTING,
            "the block counts do not sum to the model's layers",
            f"{given} sums to {sum(layout)}, num_layers={num_layers}",
            f"give {stages} counts summing to {num_layers}, e.g. {balanced}",
        )
    empty = [s for s in range(1, stages - 1) if layout[s] == 0]
    if empty:
        raise ConfigError(
            LAYOUT_SETTING,
            "a stage other than the first (the embedding) and the last (the output layer and loss) holds no block",
            f"{given}: stage {empty[0]} of {stages} is empty",
            "give every middle stage at least 1 block" + (f", e.g. {balanced}" if min(balanced[1:-1]) > 0 else ""),
        )
    return tuple(layout)


def block_counts(text: str, flag: str) -> list[int]:
    """A command line's ``3,5,5,3`` -> [3, 5, 5, 3] (checked against the model and layout with the config)."""
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise ConfigError(
            flag,
            "not a comma-separated list of block counts",
            f"got {text!r}",
            f"write one integer per pipeline stage, e.g. {flag} 3,5,5,3",
        ) from None
