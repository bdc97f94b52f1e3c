"""Interleaved 1F1B (virtual pipeline stages; Narayanan et al. 2021, sec. 2.2.2): the layers cut into v p stages,
rank r holding stages r, r + p, ..., r + (v-1) p (``LOOP`` placement, v from ``ds_megatron.parallel.virtual_stages``,
2 when unset), in Megatron's order (``schedules.interleaved_order``), run by ``pipeline_parallel.interleaved`` on
DeepSpeed's DualPipeV instructions.  The bubble is the makespan of its order under the one simulator,
(p - 1)(T_F + T_B + T_W) / v; rank 0 holds (p - 1 - r) 2 + (v - 1) p + 1 chunks' activations at m > p.  Not
searched by the tuner by default; ``--schedule`` ranks it at every v that cuts the layers evenly (a candidate carries
its v: ``tune.training.schedules``).  The helpers below also build ``interleaved_zb``'s record."""

from __future__ import annotations

import math

from ds_megatron.pipeline_parallel.schedules import interleaved_order
from ds_megatron.pipeline_parallel.schedules.record import (
    LOOP,
    ActivationTerms,
    Refusal,
    RunFacts,
    Schedule,
    fixed_shapes,
    whole_boundary_tensors,
)
from ds_megatron.pipeline_parallel.schedules.simulate import peak_held

NAME = "interleaved-1f1b"
SETTING = "virtual_stages"  # ParallelSection's field, and InterleavedModel's keyword
DEFAULT_V = 2  # model chunks per rank when the setting is unset
MODULE = "ds_megatron.pipeline_parallel.interleaved:InterleavedModel"


def multiple_of_p(schedule: Schedule, f: RunFacts) -> Refusal | None:
    """The order walks the micro-batches through each chunk in groups of p; a smaller last group would leave a rank
    waiting on a forward the order has not reached."""
    if f.grad_accum % f.pp == 0:
        return None
    valid = [f.pp * k for k in range(1, 5)]
    return Refusal(
        "gradient_accumulation_steps",
        f"the {schedule.name} schedule needs a multiple of pp micro-batches per step",
        f"gradient_accumulation_steps={f.grad_accum}, pp={f.pp}, pipeline_schedule={schedule.name!r}",
        f"use one of {valid}, ... (set train_batch_size or the micro-batch size to match)",
    )


def fp16_chunks(schedule: Schedule, f: RunFacts) -> Refusal | None:
    """fp16's loss scaling is not verified with several chunks per rank."""
    if f.precision != "fp16":
        return None
    return Refusal(
        "fp16.enabled",
        f"fp16 loss scaling is not verified under {schedule.name}",
        f"fp16=true, pipeline_schedule={schedule.name!r}",
        f'use bf16 or fp32, or pipeline_schedule "{f.fallback}"',
    )


def activation_peaks(p: int, v: int, m: int, deferred_w: bool, t: ActivationTerms) -> tuple[float, float]:
    """(first, last) rank's activation bytes, counted off the order (``simulate.peak_held``; ``t`` holds a chunk's
    terms): each chunk forward not yet backward keeps a chunk's stored activations (stage 0's also the embedding's),
    each queued W pass its chunk's share; the last rank adds the output layer's once (each of its last stage's
    forwards is followed by that micro-batch's backward)."""
    last_stage = v * p - 1
    queued = (lambda s: t.deferred_w(s == last_stage)) if deferred_w else None
    first = peak_held(
        interleaved_order.passes(p, v, m, 0, deferred_w), lambda s: t.stored + t.embedding * (s == 0), queued
    )
    last = peak_held(interleaved_order.passes(p, v, m, p - 1, deferred_w), lambda s: t.stored, queued)
    return first + t.transient, last + t.output + t.transient


def build(name: str, v: int, engine: str, deferred_w: bool) -> Schedule:
    """The record of interleaving at ``v`` chunks per rank (``deferred_w``: each backward B only, its W placed into
    the waits; ``interleaved_zb``)."""

    def bubble(p: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
        return interleaved_order.bubble(p, v, m, deferred_w, t_f, t_b, t_w)

    def critical_path(p: int, m: int, t_mb: float, t_w: float) -> tuple[float, float]:
        """As ZB-H1's: T_F = t_mb / 3, T_B + T_W = 2 t_mb / 3."""
        fill = bubble(p, m, t_mb / 3, 2 * t_mb / 3 - t_w, t_w)
        return m + fill / t_mb, fill

    return Schedule(
        name=name,
        stages_per_rank=v,
        micro_batches_per_rank=1,  # p at least (a multiple of p: multiple_of_p)
        loss_on_first_rank=False,
        module=MODULE,
        engine=engine,
        order=lambda p, m, rank: interleaved_order.passes(p, v, m, rank, deferred_w),
        bubble=bubble,
        critical_path=critical_path,
        # chunks of L/(v p) blocks, so a chunk's activations are 1/v of a 1F1B stage's
        in_flight=lambda p, rank, m: interleaved_order.peak_in_flight(p, v, m, rank) / v,
        activation_peaks=lambda p, m, t: activation_peaks(p, v, m, deferred_w, t),
        deferred_weight_grads=deferred_w,
        w_held=(
            (lambda p, rank, m: math.ceil(interleaved_order.peak_w_held(p, v, m, rank) / v))
            if deferred_w
            else (lambda p, rank, m: 0)
        ),
        placement=LOOP,
        stages_setting=SETTING,
        at_stages=lambda n: build(name, n, engine, deferred_w),
        pipeline_reason="each pipeline rank holds several stages of one pipeline",
        refusals=(multiple_of_p, fp16_chunks, whole_boundary_tensors, fixed_shapes),
    )


SCHEDULE = build(NAME, DEFAULT_V, "ds_megatron.pipeline_parallel.interleaved:InterleavedEngine", deferred_w=False)
