"""ZB-H2 (Qi et al. 2023, sec. 3.1): stage s up to 2(p - s) - 1 forwards ahead of its backwards (1F1B: p - s), the W
passes wherever a stage would wait; its order built for the costs a run measures (``schedules.zb_order``), run by
``pipeline_parallel.zero_bubble``.  Its bubble is its own order's makespan under the engines' async sends, never
longer than ZB-H1's (the order falls back to ZB-H1's where its list schedule finds nothing faster); its floor under
DeepSpeed's synchronised step is (p-1) T_F.  About twice 1F1B's peak activations.  Not searched by default: its
measurements so far are from a loaded CPU machine only."""

from __future__ import annotations

import functools

from ds_megatron.pipeline_parallel.schedules import zb_order
from ds_megatron.pipeline_parallel.schedules.record import (
    ActivationTerms,
    Schedule,
    fp16_deferred,
    loop_peaks,
    loop_slots,
)

NAME = "zb-h2"
K = zb_order.ZB_H2_FORWARDS_AHEAD


def order(p: int, m: int, rank: int) -> tuple:
    """The order built for equal costs (the first step's; later steps run one rebuilt for the measured costs)."""
    return zb_order.stream_passes(zb_order.zb_h2_streams(p, m)[rank], rank)


def critical_path(p: int, m: int, t_mb: float, t_w: float) -> tuple[float, float]:
    """T_F = t_mb / 3 as ZB-H1's.  ZB-H2 builds and times an order per cost ratio (about 0.03 s at p 8, m 64), so its
    W share is rounded to 0.05 of t_mb: a search's thousands of candidates then build a few per (p, m), and the
    bubble moves by at most (p - 1) x 0.05 t_mb."""
    if p == 1:
        return loop_slots(p, m, t_mb, t_w)
    t_w = round(t_w / t_mb * 20) / 20 * t_mb
    bubble = zb_order.bubble(True, p, m, t_mb / 3, 2 * t_mb / 3 - t_w, t_w)
    return m + bubble / t_mb, bubble


def in_flight(p: int, rank: int, m: int) -> float:
    return float(zb_order.forwards_ahead(p, rank, m, K))


def w_held(p: int, rank: int, m: int = 0) -> int:
    """One more than the largest limit its order builder may pick (``zb_order.max_w_held``)."""
    return zb_order.max_w_held(p, rank)


def activation_peaks(p: int, m: int, t: ActivationTerms) -> tuple[float, float]:
    """Twice 1F1B's forwards ahead, and beside them the W passes each stage may hold, both at once (an upper
    bound)."""
    if p == 1:
        return loop_peaks(p, m, t)
    first = in_flight(p, 0, m) * (t.stored + t.embedding) + t.transient
    first += w_held(p, 0) * t.deferred_w(False)
    last = in_flight(p, p - 1, m) * t.stored + t.output + t.transient
    last += w_held(p, p - 1) * t.deferred_w(True)
    return first, last


SCHEDULE = Schedule(
    name=NAME,
    stages_per_rank=1,
    micro_batches_per_rank=0,
    loss_on_first_rank=False,
    module="ds_megatron.pipeline_parallel.module:PipelineModel",
    engine="ds_megatron.pipeline_parallel.zero_bubble:ZeroBubbleH2PipelineEngine",
    order=order,
    bubble=functools.partial(zb_order.bubble, True),
    critical_path=critical_path,
    in_flight=in_flight,
    activation_peaks=activation_peaks,
    deferred_weight_grads=True,
    w_held=w_held,
    pipeline_reason="with one stage there is no bubble for the W passes to fill",
    refusals=(fp16_deferred,),
)
