"""The pipeline schedules the tuner ranks: the records' names, the ones searched by default, the stages per rank
(v) a schedule whose record has a stages setting is searched at, and why a schedule cannot run at a layout.  Each
schedule's time and memory terms are its record's (``pipeline_parallel.schedules``: ``Schedule.critical_path``,
``Schedule.bubble``, ``Schedule.activation_peaks``), at the candidate's v (``Schedule.for_settings``).  Pure Python."""

from __future__ import annotations

import functools

from ds_megatron.pipeline_parallel.schedules import DEFAULT as DEFAULT_RECORD
from ds_megatron.pipeline_parallel.schedules import SCHEDULES as RECORDS
from ds_megatron.pipeline_parallel.schedules import RunFacts, schedule_named

# The config's names, one owner.  A schedule whose stages per rank a setting chooses (``Schedule.stages_setting``:
# interleaving's virtual stages) is searched at every v that cuts the layers evenly (``virtual_stage_options``).
SCHEDULES = tuple(schedule.name for schedule in RECORDS)
# Searched unless --schedule says otherwise (``Schedule.searched``: the others' time-model gains are not yet trusted
# enough to change a winner).  --schedule all ranks them together.
DEFAULT_SCHEDULES = tuple(schedule.name for schedule in RECORDS if schedule.searched)
ALL = "all"
STAGED = tuple(schedule.name for schedule in RECORDS if schedule.stages_setting is not None)  # carry a v
# The deferred-W share of a micro-batch (T_W / t_mb) a deferred-W schedule's simulated critical path is cached at,
# rounded to this many decimals (interleaved-zb's order simulates in about a second at p 8, v 4, m 64).
W_SHARE_DECIMALS = 2


def has_stages_setting(schedule: str) -> bool:
    """Whether a setting chooses ``schedule``'s stages per rank (a candidate then carries its v)."""
    return schedule_named(schedule).stages_setting is not None


def virtual_stage_options(schedule: str, num_layers: int, pp: int, pinned: int | None = None) -> list[int | None]:
    """The stages per rank to search ``schedule`` at: [None] for a schedule with a fixed count; else every v >= 2
    with num_layers divisible by pp x v (each of the v p model chunks the same number of blocks), or the pinned v
    where it divides them (``validate`` refuses a pinned v that does not)."""
    if not has_stages_setting(schedule):
        return [None]
    valid = [v for v in range(2, num_layers // pp + 1) if num_layers % (pp * v) == 0]
    return [v for v in valid if pinned is None or v == pinned]


def refusal(schedule: str, pp: int, num_micro_batches: int) -> str | None:
    """Why ``schedule`` cannot run at ``pp`` stages and ``num_micro_batches`` micro-batches (None: it can); for a
    schedule with a stages setting also its record's own refusals of the micro-batch count (interleaving's multiple
    of pp), read for a bf16 run with DeepSpeed's default pipeline section (what the tuner writes)."""
    if schedule not in SCHEDULES:
        return f"unknown schedule (use one of {', '.join(SCHEDULES)} or {ALL})"
    record = schedule_named(schedule)
    if record.pipeline_reason is not None and pp == 1:
        return f"{schedule} needs pp > 1 ({record.pipeline_reason})"
    if num_micro_batches < record.micro_batches_per_rank * pp:
        per_rank = record.micro_batches_per_rank
        return f"{schedule} needs m >= {per_rank} x pp (DualPipeVSchedule refuses fewer micro-batches)"
    if record.stages_setting is not None:
        found = record.refuse(RunFacts(1, pp, num_micro_batches, "bf16", {}, DEFAULT_RECORD.name))
        if found is not None:
            return f"{found.problem} (m = {num_micro_batches}, pp = {pp})"
    return None


def critical_path(cand, t_mb: float, t_w: float) -> tuple[float, float]:
    """(slots of ``t_mb``, bubble in s) of ``cand``'s schedule at its v (``Schedule.critical_path``).  A schedule
    with a stages setting is simulated once per (v, p, m) at t_mb = 1 and scaled: the one simulator's makespan is
    linear in the pass costs, so this is the record's own figure (a deferred-W one at its T_W share rounded to
    W_SHARE_DECIMALS); the others call the record."""
    record = schedule_named(cand.schedule).for_settings(cand)
    p, m = cand.pp, cand.num_micro_batches
    if record.stages_setting is None or t_mb <= 0:
        return record.critical_path(p, m, t_mb, t_w)
    share = round(t_w / t_mb, W_SHARE_DECIMALS) if record.deferred_weight_grads else 0.0
    slots = _unit_slots(cand.schedule, record.per_rank(cand), p, m, share)
    return slots, (slots - m) * t_mb


@functools.lru_cache(maxsize=4096)
def _unit_slots(schedule: str, v: int, p: int, m: int, w_share: float) -> float:
    return schedule_named(schedule, v).critical_path(p, m, 1.0, w_share)[0]


def bubble_s(schedule: str, p: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """The part of one step's critical path spent filling and draining the pipeline, for a stage whose forward,
    input-gradient (B) and weight-gradient (W) passes take ``t_f``, ``t_b`` and ``t_w`` seconds per micro-batch
    (``Schedule.bubble``; 1F1B (p-1)(T_F+T_B+T_W), the others their orders' simulated makespans less
    m (T_F+T_B+T_W))."""
    return schedule_named(schedule).bubble(p, m, t_f, t_b, t_w)
