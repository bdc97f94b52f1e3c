"""DualPipeV with its weight gradients deferred into the drain (DeepSeek-V3's DualPipe, its "zero bubble" drain):
DualPipeV's module and layout, the engine of ``pipeline_parallel.dualpipev_zb``; the backward passes before
DeepSpeed's empty W slots run B only (``schedules.v_order.compute_order``).  DualPipeV's activations in flight
(no W pass is queued at any forward) plus up to r + 1 queued W passes on rank r in the drain."""

from __future__ import annotations

from ds_megatron.pipeline_parallel.schedules import v_order
from ds_megatron.pipeline_parallel.schedules.record import (
    Schedule,
    V,
    fixed_shapes,
    fp16_two_stages,
    whole_boundary_tensors,
)

NAME = "dualpipev-zb"
# Chunk F : B : W cost of the tuner's simulation: the time model's count (the input gradient and the weight gradient
# are each one GEMM of the forward's shapes), DualPipeV's 1 : 2 with its backward split in two.
COSTS = (1.0, 1.0, 1.0)


def simulate(p: int, m: int, forward: float, backward: float, weight: float) -> float:
    """The makespan of one step with each chunk's forward costing ``forward``, B ``backward`` and W ``weight``.  At
    the time model's 1 : 1 : 1 it equals the makespan of DeepSpeed's instruction streams under batched p2p."""
    return v_order.makespan(p, m, True, forward, backward, weight)


def slots(p: int, m: int) -> float:
    return v_order.slots(p, m, True, COSTS)


def peak_bytes(p: int, m: int, rank: int, phase_bytes: tuple[float, float], w_bytes: tuple[float, float]) -> float:
    return v_order.peak_bytes(p, m, rank, True, phase_bytes, w_bytes)


SCHEDULE = Schedule(
    name=NAME,
    stages_per_rank=2,
    micro_batches_per_rank=2,
    loss_on_first_rank=True,
    module="ds_megatron.pipeline_parallel.dualpipev:DualPipeVModel",
    engine="ds_megatron.pipeline_parallel.dualpipev_zb:DualPipeVZeroBubbleEngine",
    order=lambda p, m, rank: v_order.passes(p, m, rank, split=True),
    bubble=lambda p, m, t_f, t_b, t_w: v_order.bubble(p, m, True, t_f, t_b, t_w),
    critical_path=lambda p, m, t_mb, t_w: (slots(p, m), (slots(p, m) - m) * t_mb),
    in_flight=lambda p, rank, m: (2 * p + 1) / 2,
    activation_peaks=lambda p, m, t: v_order.peaks(p, m, True, t),
    deferred_weight_grads=True,
    w_held=lambda p, rank, m: rank + 1,  # none while a forward runs (pipeline_parallel.dualpipev_zb)
    placement=V,
    pipeline_reason="each pipeline rank holds two stages of one pipeline",
    refusals=(whole_boundary_tensors, fixed_shapes, fp16_two_stages),
)
