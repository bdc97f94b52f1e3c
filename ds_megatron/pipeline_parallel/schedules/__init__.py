"""L0.1: the pipeline schedules, one record each (``record.Schedule``: stages per rank and their placement, the
per-rank order of passes, the one timing model's makespan and bubble, activations in flight, refusals, the tuner's
defaults, and the engine and module that run it, imported on first use), and the one registry every other module
reads.  Standard library only: the config, the memory formulas and the tuner read it without torch.  Nothing outside
this folder names a schedule (tests/unit/test_layering.py keeps it so).  A new schedule: its record here and one line
below, its engine in ``pipeline_parallel/``, a test."""

from __future__ import annotations

from typing import Any

from ds_megatron.pipeline_parallel.schedules import (
    dualpipev,
    dualpipev_zb,
    interleaved_1f1b,
    interleaved_zb,
    one_f_one_b,
    zb_h1,
    zb_h2,
)
from ds_megatron.pipeline_parallel.schedules.record import ActivationTerms, Refusal, RunFacts, Schedule

SCHEDULES: tuple[Schedule, ...] = tuple(
    s.SCHEDULE for s in (one_f_one_b, dualpipev, zb_h1, zb_h2, dualpipev_zb, interleaved_1f1b, interleaved_zb)
)  # the first is the default
DEFAULT = SCHEDULES[0]
BY_NAME = {s.name: s for s in SCHEDULES}


def schedule_named(name: str, per_rank: int | None = None) -> Schedule:
    """The schedule called ``name`` (KeyError for an unknown one: the config loader refuses those first); for one
    whose stages per rank a setting chooses, at ``per_rank`` of them (None: its default)."""
    schedule = BY_NAME[name]
    if per_rank is None or schedule.at_stages is None or per_rank == schedule.stages_per_rank:
        return schedule
    return schedule.at_stages(per_rank)


def schedule_of(run: Any) -> Schedule:
    """The pipeline schedule of a resolved run (``config.RunConfig``), at the run's stages per rank."""
    return BY_NAME[run.section.parallel.pipeline_schedule].for_settings(run.section.parallel)


def module_class(name: str) -> Any:
    """The pipeline module class of schedule ``name`` (imports torch and deepspeed)."""
    return BY_NAME[name].module_class()


__all__ = [
    "BY_NAME",
    "DEFAULT",
    "SCHEDULES",
    "ActivationTerms",
    "Refusal",
    "RunFacts",
    "Schedule",
    "module_class",
    "schedule_named",
    "schedule_of",
]
