"""DualPipeV: DeepSpeed's ``DualPipeVModule`` / ``DualPipeVEngine`` (``DualPipeVSchedule``), with async sends
(``pipeline_parallel.p2p``).  The layers are cut into 2p stages; rank r holds stage r (phase 0, activations flowing
towards rank p-1) and stage 2p-1-r (phase 1, back towards rank 0), so rank 0 holds the embedding and the loss, and
its schedule needs 2p micro-batches in flight to fill the pipeline from both ends: 2p + 1 chunks (half stages) in
flight on every rank.  Its bubble is the makespan of its order (``schedules.v_order``).  Not searched by default:
not measured yet."""

from __future__ import annotations

from ds_megatron.pipeline_parallel.schedules import v_order
from ds_megatron.pipeline_parallel.schedules.record import (
    Schedule,
    V,
    fixed_shapes,
    fp16_two_stages,
    whole_boundary_tensors,
)

NAME = "dualpipev"
# Chunk forward : backward cost of the tuner's simulation: the time model's own count (a backward runs the input and
# the weight gradients, two GEMMs of the forward's shapes).
COSTS = (1.0, 2.0)


def simulate(p: int, m: int, forward: float = 1.0, backward: float = 2.0) -> float:
    """The makespan of one step with every chunk's forward costing ``forward`` and its backward ``backward``."""
    return v_order.makespan(p, m, False, forward, backward)


def slots(p: int, m: int) -> float:
    return v_order.slots(p, m, False, COSTS)


def peak_bytes(p: int, m: int, rank: int, phase_bytes: tuple[float, float]) -> float:
    return v_order.peak_bytes(p, m, rank, False, phase_bytes)


SCHEDULE = Schedule(
    name=NAME,
    stages_per_rank=2,
    micro_batches_per_rank=2,
    loss_on_first_rank=True,
    module="ds_megatron.pipeline_parallel.dualpipev:DualPipeVModel",
    engine="ds_megatron.pipeline_parallel.p2p:AsyncSendDualPipeVEngine",
    order=lambda p, m, rank: v_order.passes(p, m, rank, split=False),
    bubble=lambda p, m, t_f, t_b, t_w: v_order.bubble(p, m, False, t_f, t_b, t_w),
    critical_path=lambda p, m, t_mb, t_w: (slots(p, m), (slots(p, m) - m) * t_mb),
    in_flight=lambda p, rank, m: (2 * p + 1) / 2,
    activation_peaks=lambda p, m, t: v_order.peaks(p, m, False, t),
    placement=V,
    pipeline_reason="each pipeline rank holds two stages of one pipeline",
    refusals=(whole_boundary_tensors, fixed_shapes, fp16_two_stages),
)
