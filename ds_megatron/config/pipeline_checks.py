"""Pre-launch checks of ``ds_megatron.parallel.pipeline_schedule`` (standard library only): what each schedule needs
of the layout, the batch and the rest of the config (its record's refusals, ``pipeline_parallel.schedules``), refused
in one line before any process exists."""

from __future__ import annotations

from typing import Any

from ds_megatron.config.errors import ConfigError
from ds_megatron.config.facts import precision
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
