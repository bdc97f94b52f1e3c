"""ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 3.1): DeepSpeed's 1F1B with each backward split
into B (input gradients) and a deferred W (weight gradients), stage s holding back up to s W passes
(``schedules.zb_order.zb_h1_streams``), run by ``pipeline_parallel.zero_bubble``.  1F1B's activations in flight;
at T_F = T_B = T_W (and whenever T_W <= T_F <= T_B) the fill and drain shrink from (p-1)(T_F+T_B+T_W) to
(p-1)(T_F+T_B-T_W), W filling the cooldown slots; a W dearer than a forward fills less (at T_F 0.8, T_B 1, T_W 0.9:
(p-1) T_B, not 0.9 (p-1)).  Not searched by default: measured on CPU only, where the split backward's extra work
ate most of the idle time it saved (benchmarks/results/zero_bubble_async.md)."""

from __future__ import annotations

import functools

from ds_megatron.pipeline_parallel.schedules import zb_order
from ds_megatron.pipeline_parallel.schedules.record import (
    ActivationTerms,
    Schedule,
    fp16_deferred,
    loop_in_flight,
    loop_peaks,
    loop_slots,
)

NAME = "zb-h1"


def order(p: int, m: int, rank: int) -> tuple:
    return zb_order.stream_passes(zb_order.zb_h1_streams(p, m)[rank], rank)


def critical_path(p: int, m: int, t_mb: float, t_w: float) -> tuple[float, float]:
    """The model's backward is two forwards' GEMMs, W its weight-gradient share: T_F = t_mb / 3.  ZB-H1's order is
    one per (p, m) and cheap to time, so its W share is exact ((p-1)(t_mb - 2 T_W) at T_W below T_F)."""
    if p == 1:
        return loop_slots(p, m, t_mb, t_w)
    bubble = zb_order.bubble(False, p, m, t_mb / 3, 2 * t_mb / 3 - t_w, t_w)
    return m + bubble / t_mb, bubble


def activation_peaks(p: int, m: int, t: ActivationTerms) -> tuple[float, float]:
    """1F1B's micro-batches in flight, and stage s holds back up to s W passes: none on the first stage; the last
    keeps p - 1 of them beside its one micro-batch in flight, and p (none in flight) in the cooldown, between a B
    and the W it makes due.  Between the two ends a stage's peak is linear in s, so the ends are the peaks."""
    first, last = loop_peaks(p, m, t)
    if p > 1:
        held = t.deferred_w(True)
        last = max(last - t.transient, held) + (p - 1) * held + t.transient
    return first, last


SCHEDULE = Schedule(
    name=NAME,
    stages_per_rank=1,
    micro_batches_per_rank=0,
    loss_on_first_rank=False,
    module="ds_megatron.pipeline_parallel.module:PipelineModel",
    engine="ds_megatron.pipeline_parallel.zero_bubble:ZeroBubblePipelineEngine",
    order=order,
    bubble=functools.partial(zb_order.bubble, False),
    critical_path=critical_path,
    in_flight=loop_in_flight,
    activation_peaks=activation_peaks,
    deferred_weight_grads=True,
    w_held=lambda p, rank, m: rank + 1,  # rank while it runs forwards, one more in the cooldown
    pipeline_reason="with one stage there is no bubble for the W passes to fill",
    refusals=(fp16_deferred,),
)
