"""1F1B: DeepSpeed's ``PipelineEngine`` running its ``TrainSchedule`` (stage r on rank r, one forward then one
backward in the steady state, p - r micro-batches in flight on rank r), with async sends like every schedule's
(``pipeline_parallel.p2p``).  The default, and the schedule every refusal of another one suggests."""

from __future__ import annotations

from ds_megatron.pipeline_parallel.schedules import zb_order
from ds_megatron.pipeline_parallel.schedules.record import Schedule, loop_bubble, loop_in_flight, loop_peaks, loop_slots

NAME = "1f1b"

SCHEDULE = Schedule(
    name=NAME,
    stages_per_rank=1,
    micro_batches_per_rank=0,
    loss_on_first_rank=False,
    module="ds_megatron.pipeline_parallel.module:PipelineModel",
    engine="ds_megatron.pipeline_parallel.p2p:AsyncSendPipelineEngine",
    order=zb_order.one_f_one_b_order,
    bubble=loop_bubble,
    critical_path=loop_slots,
    in_flight=loop_in_flight,
    activation_peaks=loop_peaks,
    searched=True,
)
