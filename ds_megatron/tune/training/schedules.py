"""The pipeline schedules the tuner ranks: the records' names, the ones searched by default, and why a schedule
cannot run at a layout.  Each schedule's time and memory terms are its record's (``pipeline_parallel.schedules``:
``Schedule.slots``, ``Schedule.bubble``, ``Schedule.activation_peaks``).  Pure Python."""

from __future__ import annotations

from ds_megatron.pipeline_parallel.schedules import SCHEDULES as RECORDS
from ds_megatron.pipeline_parallel.schedules import schedule_named

# The config's names, one owner, less those whose stages per rank a setting chooses (``Schedule.stages_setting``:
# interleaving's virtual stages): a candidate carries no such count, so the tuner neither proposes nor ranks them.
SCHEDULES = tuple(schedule.name for schedule in RECORDS if schedule.stages_setting is None)
# Searched unless --schedule says otherwise (``Schedule.searched``: the others' time-model gains are not yet trusted
# enough to change a winner).  --schedule all ranks them together.
DEFAULT_SCHEDULES = tuple(schedule.name for schedule in RECORDS if schedule.searched)
ALL = "all"


def refusal(schedule: str, pp: int, num_micro_batches: int) -> str | None:
    """Why ``schedule`` cannot run at ``pp`` stages and ``num_micro_batches`` micro-batches (None: it can)."""
    if schedule not in SCHEDULES:
        return f"unknown schedule (use one of {', '.join(SCHEDULES)} or {ALL})"
    record = schedule_named(schedule)
    if record.pipeline_reason is not None and pp == 1:
        return f"{schedule} needs pp > 1 ({record.pipeline_reason})"
    if num_micro_batches < record.micro_batches_per_rank * pp:
        per_rank = record.micro_batches_per_rank
        return f"{schedule} needs m >= {per_rank} x pp (DualPipeVSchedule refuses fewer micro-batches)"
    return None


def bubble_s(schedule: str, p: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """The part of one step's critical path spent filling and draining the pipeline, for a stage whose forward,
    input-gradient (B) and weight-gradient (W) passes take ``t_f``, ``t_b`` and ``t_w`` seconds per micro-batch
    (``Schedule.bubble``; 1F1B (p-1)(T_F+T_B+T_W), the others their orders' simulated makespans less
    m (T_F+T_B+T_W))."""
    return schedule_named(schedule).bubble(p, m, t_f, t_b, t_w)
