"""What a pipeline schedule is: the record each schedule's module fills in (``schedules/<schedule>.py``) and the
registry (``schedules.SCHEDULES``) hands to the config, the memory formulas, the engine and the tuner.  Standard
library only; the engine and the pipeline module that run a schedule are dotted paths imported on first use."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from ds_megatron.pipeline_parallel.schedules.zb_order import forwards_ahead

SETTING = "ds_megatron.parallel.pipeline_schedule"
LOOP, V = "loop", "v"  # placements: stage r + k p on rank r (k < stages per rank), or DualPipeV's r and 2p-1-r


class RunFacts(NamedTuple):
    """What a schedule's refusals read of a run's configuration."""

    tp: int
    pp: int
    grad_accum: int  # micro-batches per step (gradient_accumulation_steps)
    precision: str  # "fp32", "bf16" or "fp16" (config.facts.precision)
    pipeline: dict  # DeepSpeed's "pipeline" section
    fallback: str  # the schedule every refusal suggests instead (the registry's default)


class Refusal(NamedTuple):
    """One refusal, the parts of a ``config.ConfigError``: setting, problem, values, fix."""

    setting: str
    problem: str
    values: str
    fix: str


class ActivationTerms(NamedTuple):
    """The tuner's activation bytes of one micro-batch on a rank's stage (``Schedule.stages_per_rank`` x pp stages
    in the model; ``tune.core.memory_model``): what ``Schedule.activation_peaks`` combines by the schedule's order."""

    stored: float  # a stage's blocks' stored activations
    transient: float  # the recompute transient (once per rank)
    embedding: float  # what the embedding adds on the first stage
    output: float  # what the output layer and the loss add on the last stage
    deferred_w: Callable[[bool], float]  # a queued W pass of a stage's blocks (True: the last stage's, output layer)


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule (the value of ``ds_megatron.parallel.pipeline_schedule``).

    ``order``, ``bubble``, ``critical_path``, ``in_flight``, ``w_held`` and ``activation_peaks`` are functions of
    (p, m, ...) only; ``refusals`` each take (the schedule, ``RunFacts``) and return a ``Refusal`` or None."""

    name: str
    stages_per_rank: int  # pipeline stages (model chunks) each pipeline rank holds (v: stages_setting's default)
    micro_batches_per_rank: int  # gradient_accumulation_steps must be >= this x pp (0: any count)
    loss_on_first_rank: bool  # the loss (and the output layer) lives on pipeline rank 0, not on rank pp - 1
    module: str  # "package.module:Class" of the pipeline module the engine is built on
    engine: str  # "package.module:Class" of the engine installed on DeepSpeed's after deepspeed.initialize
    order: Callable[[int, int, int], tuple]  # (p, m, rank) -> the rank's passes ("F" | "B" | "BW" | "W", stage, mb)
    bubble: Callable[..., float]  # (p, m, t_f, t_b, t_w) -> seconds of the step's critical path filling and draining
    critical_path: Callable[..., tuple[float, float]]  # (p, m, t_mb, t_w) -> the tuner's (slots of t_mb, bubble s)
    in_flight: Callable[[int, int, int], float]  # (p, rank, m) -> micro-batches' activations held, in 1F1B stages
    activation_peaks: Callable[[int, int, ActivationTerms], tuple[float, float]]  # (p, m, terms) -> (first, last)
    deferred_weight_grads: bool = False  # the backward runs B only; W passes run later (pipeline_parallel.zero_bubble)
    w_held: Callable[[int, int, int], int] = lambda p, rank, m: 0  # (p, rank, m) -> most deferred W passes held
    placement: str = LOOP  # LOOP or V (see stages_of)
    # A ParallelSection field choosing the stages per rank (None: fixed), also the keyword the module class takes it
    # by; with it, at_stages(v) is the record at v stages per rank (its order, bubble and in-flight counts are v's).
    stages_setting: str | None = None
    at_stages: Callable[[int], Schedule] | None = None
    pipeline_reason: str | None = None  # why pp 1 is refused (the tuner's words); None: runs at pp 1
    searched: bool = False  # the tuner ranks it unless --schedule says otherwise
    refusals: tuple[Callable[[Schedule, RunFacts], Refusal | None], ...] = ()

    def per_rank(self, settings: Any = None) -> int:
        """Stages each pipeline rank holds: the value of ``stages_setting`` in ``settings`` (the run's
        ``ParallelSection``) for a schedule that lets the user choose it (interleaved 1F1B's virtual stages), else
        ``stages_per_rank``."""
        if self.stages_setting is None or settings is None:
            return self.stages_per_rank
        if isinstance(settings, Mapping):  # a saved config's "parallel" section
            value = settings.get(self.stages_setting)
        else:  # a ParallelSection (the tuner's candidates have no such field: the default)
            value = getattr(settings, self.stages_setting, None)
        return self.stages_per_rank if value is None else value

    def for_settings(self, settings: Any = None) -> Schedule:
        """This schedule at ``per_rank(settings)`` stages per rank (itself unless the setting chooses another
        count): what the engine, the memory formulas and the layout read for a run."""
        v = self.per_rank(settings)
        return self if v == self.stages_per_rank or self.at_stages is None else self.at_stages(v)

    def stages_of(self, rank: int, pp: int, per_rank: int | None = None) -> tuple[int, ...]:
        """The stages (of ``pp * per_rank``, in model order) pipeline rank ``rank`` builds, in the order it registers
        their parameters: LOOP r, r + p, ..., r + (v-1) p (1F1B: stage r); V the V's r and 2p-1-r."""
        v = self.stages_per_rank if per_rank is None else per_rank
        if self.placement == V:
            return (rank, 2 * pp - 1 - rank)
        return tuple(rank + k * pp for k in range(v))

    def loss_rank(self, pp: int) -> int:
        """The pipeline rank that computes the loss (holds the output layer)."""
        return 0 if self.loss_on_first_rank else pp - 1

    def module_class(self, settings: Any = None) -> Any:
        """The pipeline module class (imports torch and deepspeed); for a schedule whose stages per rank a setting
        chooses, bound to ``per_rank(settings)`` by the setting's name (the module's keyword)."""
        cls = _load(self.module)
        if self.stages_setting is None:
            return cls
        return functools.partial(cls, **{self.stages_setting: self.per_rank(settings)})

    def engine_class(self) -> Any:
        """The engine class installed on the one ``deepspeed.initialize`` builds (imports torch and deepspeed)."""
        return _load(self.engine)

    def refuse(self, facts: RunFacts) -> Refusal | None:
        """The first refusal of this schedule for a run (None: it runs)."""
        for refusal in self.refusals:
            found = refusal(self, facts)
            if found is not None:
                return found
        return None


def _load(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


# Refusals shared by several schedules; each record lists the ones its engine needs.


def stages_setting_refusal(schedule: Schedule, setting: str, value: Any, readers: list[str]) -> Refusal | None:
    """A stages-per-rank setting (``Schedule.stages_setting``) given to a schedule that does not read it, or not an
    integer >= 2 (one stage per rank is the default schedule's loop); ``readers``: the schedules that read it."""
    if value is None:
        return None
    full = f"ds_megatron.parallel.{setting}"
    if schedule.stages_setting != setting:
        return Refusal(
            full,
            f"only a schedule with {setting.replace('_', ' ')} reads it",
            f"{setting}={value!r}, pipeline_schedule={schedule.name!r}",
            f"remove it, or set pipeline_schedule to one of {readers}",
        )
    if type(value) is not int or value < 2:
        return Refusal(
            full,
            "model chunks per pipeline rank must be an integer >= 2 (one chunk per rank is the plain loop)",
            f"{setting}={value!r}",
            f"set {setting} >= 2",
        )
    return None


def fp16_deferred(schedule: Schedule, f: RunFacts) -> Refusal | None:
    """fp16's wrappers scale and accumulate 16-bit gradients in backward; deferred weight gradients bypass that."""
    if f.precision != "fp16":
        return None
    return Refusal(
        SETTING,
        f"{schedule.name} is not supported with fp16",
        f"pipeline_schedule={schedule.name!r}, fp16.enabled=true",
        f'use bf16 or fp32, or pipeline_schedule "{f.fallback}"',
    )


def whole_boundary_tensors(schedule: Schedule, f: RunFacts) -> Refusal | None:
    """DeepSpeed's DualPipeV instructions (its engine's, and interleaved 1F1B's, built on them) send whole
    stage-boundary tensors: not TP-partitioned."""
    for key in ("pipe_partitioned", "grad_partitioned"):
        if f.tp > 1 and f.pipeline.get(key):
            return Refusal(
                f"pipeline.{key}",
                f"DeepSpeed's {schedule.name} engine sends whole stage-boundary tensors (no TP partitioning)",
                f"{key}=true, tp={f.tp}, pipeline_schedule={schedule.name!r}",
                f"remove pipeline.{key} (ds_megatron turns it off)",
            )
    return None


def fixed_shapes(schedule: Schedule, f: RunFacts) -> Refusal | None:
    """DeepSpeed's DualPipeV instructions (its engine's, and interleaved 1F1B's) exchange the boundary tensors' shapes
    once."""
    if not f.pipeline.get("dynamic_shape"):
        return None
    return Refusal(
        "pipeline.dynamic_shape",
        f"DeepSpeed's {schedule.name} engine exchanges the boundary tensors' shapes once",
        f"dynamic_shape=true, pipeline_schedule={schedule.name!r}",
        "remove pipeline.dynamic_shape (ds_megatron's boundary tensors have fixed shapes)",
    )


def fp16_two_stages(schedule: Schedule, f: RunFacts) -> Refusal | None:
    """Measured on deepspeed 0.19.8, tiny GPT-2 at pp 2: the third step's gradient norm was 1.647 under DualPipeV and
    1.832 under 1F1B with the same weights and data (bf16 and fp32 agree to the last digit): the fp16 wrapper's loss
    scaling meets the two phases' backward passes in a way DeepSpeed does not test."""
    if f.precision != "fp16":
        return None
    return Refusal(
        "fp16.enabled",
        f"fp16 under the {schedule.name} schedule gives other gradients than {f.fallback} (its loss scaling is not "
        "verified with two stages per rank)",
        f"fp16=true, pipeline_schedule={schedule.name!r}",
        f'use bf16 (with "data_types": {{"grad_accum_dtype": "fp32"}}) or pipeline_schedule "{f.fallback}"',
    )


# The tuner's and the memory formulas' terms shared by the one-stage-per-rank schedules.


def loop_in_flight(p: int, rank: int, m: int) -> float:
    """1F1B's micro-batches in flight on rank ``rank``: min(p - rank, m)."""
    return float(forwards_ahead(p, rank, m, 1))


def loop_slots(p: int, m: int, t_mb: float, t_w: float) -> tuple[float, float]:
    """1F1B's critical path: m + p - 1 slots of t_mb, bubble (p - 1) t_mb."""
    return m + p - 1, (p - 1) * t_mb


def loop_bubble(p: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """1F1B's fill and drain: (p - 1)(T_F + T_B + T_W), exact for equal stage costs."""
    return 0.0 if p == 1 else (p - 1) * (t_f + t_b + t_w)


def loop_peaks(p: int, m: int, t: ActivationTerms) -> tuple[float, float]:
    """(first, last) rank's activation bytes under 1F1B: the first stage keeps min(p, m) micro-batches in flight,
    the last one; at pp 1 the one stage adds the output layer's."""
    first = min(p, m) * (t.stored + t.embedding) + t.transient
    last = t.stored + t.output + t.transient
    if p == 1:
        first = last = first + t.output
    return first, last
