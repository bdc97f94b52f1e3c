"""Pre-launch checks of ``ds_megatron.parallel.pipeline_schedule`` (standard library only): what each schedule needs
of the layout, the batch and the rest of the config (its record's refusals, ``pipeline_parallel.schedules``), refused
in one line before any process exists."""

from __future__ import annotations

from ds_megatron.config.errors import ConfigError
from ds_megatron.config.facts import precision
from ds_megatron.pipeline_parallel.schedules import DEFAULT, SCHEDULES, RunFacts, Schedule, schedule_named
from ds_megatron.pipeline_parallel.schedules.record import SETTING


def check_schedule_name(name: str, pp: int) -> Schedule:
    """The schedule called ``name``; refused when unknown, or when it needs a pipeline and pp is 1."""
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
    return schedule


def check_schedule_run(schedule: Schedule, ds_config: dict, tp: int, pp: int, grad_accum: int) -> None:
    """What the engine of ``schedule`` cannot run: too few micro-batches, then the record's own refusals."""
    need = schedule.micro_batches_per_rank * pp
    if grad_accum < need:
        raise ConfigError(
            "gradient_accumulation_steps",
            f"the {schedule.name} schedule needs at least {schedule.micro_batches_per_rank} x pp micro-batches per "
            "step (it fills the pipeline from both ends)",
            f"gradient_accumulation_steps={grad_accum}, pp={pp}, pipeline_schedule={schedule.name!r}",
            f"set gradient_accumulation_steps >= {need} (raise train_batch_size or lower the micro-batch size)",
        )
    facts = RunFacts(tp, pp, grad_accum, precision(ds_config), ds_config.get("pipeline") or {}, DEFAULT.name)
    refusal = schedule.refuse(facts)
    if refusal is not None:
        raise ConfigError(*refusal)
