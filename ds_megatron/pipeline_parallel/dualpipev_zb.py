"""DualPipeV with deferred weight gradients (DeepSeek-V3's DualPipe, its "zero bubble" drain) on DeepSpeed's engine.

DeepSpeed's ``DualPipeVSchedule`` runs every backward pass whole and leaves an empty communication commit
(``CommitP2P``) where DualPipe runs a W pass: one in each of the phase-1 backward-forward pairs after the warm-up
(``p - r - 1`` on rank r), one before each phase-0 backward of the drain (``p - r - 1``) and one at each of the
last ``r + 1`` slots, where the rank waits for its downstream ranks' gradients.  :class:`DualPipeVZeroBubbleSchedule`
yields DeepSpeed's stream unchanged and fills those slots: the backward passes just before them are B only (input
gradients: what the upstream rank waits for), their W passes (weight gradients, which nobody needs before the step)
run at the slots, oldest first.  Deferred are the phase-1 backward of each warm-up pair, the last ``r + 1``
backward passes of the B1 B0 drain and the phase-0 backward of each of the drain's W B0 steps: as many as there are
slots, so each slot runs one W pass and none is left for the step.  Every other backward pass runs its W pass right
after its B, as DeepSpeed's does.  A W pass runs after the slot's commit: the sends of the B before it are then on
their way and the rank computes while its peers do.

Memory: no W pass is queued when a forward runs, so the micro-batches in flight are DualPipeV's; in the drain rank
r queues up to r + 1, each keeping its linears' inputs and output gradients
(``memory.deferred_weight_grad_bytes_per_layer``) while its backward passes free chunks: the peak stays DualPipeV's
while a queued W pass keeps at most two chunks' activations (``schedules.dualpipev_zb.peak_bytes`` counts both).

:class:`DualPipeVZeroBubbleEngine` executes it on top of DeepSpeed's ``DualPipeVEngine``: each backward pass seals
its W pass in the rank's queue, ``WeightGradPass`` runs the oldest one with ZB-H1's framing for DeepSpeed's BF16
optimizer, ``ReduceTiedGrads`` (the first of the step's reduction instructions) runs any left first, and the
optimizer step refuses to run with W passes still queued.
"""

from __future__ import annotations

from deepspeed.runtime.pipe import schedule

from ds_megatron.pipeline_parallel.p2p import AsyncSendDualPipeVEngine
from ds_megatron.pipeline_parallel.schedules import v_order as order
from ds_megatron.pipeline_parallel.zero_bubble import DeferredWeightGradSteps, WeightGradPass


class DualPipeVZeroBubbleSchedule(schedule.DualPipeVSchedule):
    """DeepSpeed's DualPipeV order with W passes split off the backward passes before its empty W slots."""

    def steps(self):
        if self.forward_only:
            yield from super().steps()
            return
        rank = self.stage_id
        steps = order.step_of(self.stages, self.micro_batches, rank)
        # The W slots are found by counting DeepSpeed's steps: checked before the engine runs any of them.
        ds_steps = list(super().steps())
        if len(ds_steps) != len(steps):
            raise RuntimeError(
                f"DeepSpeed's DualPipeVSchedule yielded {len(ds_steps)} steps, not the {len(steps)} this schedule "
                "places its W passes by (checked on deepspeed 0.19.8)"
            )
        pending = 0  # deferred W passes not yet run
        drain_index = 0  # backward passes of the B1 B0 drain so far
        for step, cmds in zip(steps, ds_steps):
            slot = self._w_slot(step, cmds)
            out = []
            for position, cmd in enumerate(cmds):
                if isinstance(cmd, schedule.ReduceTiedGrads):
                    out += [WeightGradPass() for _ in range(pending)]  # none: every deferred W pass had a slot
                    pending = 0
                out.append(cmd)
                if isinstance(cmd, schedule.BackwardPass):
                    if order.deferred(step, cmd.phase, drain_index, rank):
                        pending += 1
                    else:
                        out.append(WeightGradPass())  # the backward pass whole, as DeepSpeed runs it
                    drain_index += step == order.B1_B0
                if position == slot and pending:
                    out.append(WeightGradPass())
                    pending -= 1
            yield out

    @staticmethod
    def _w_slot(step: int, cmds: list) -> int | None:
        """The position in ``cmds`` of DeepSpeed's W placeholder, the commit the W pass follows: in a B1 W F1 list
        the second commit (the first belongs to the backward's receive), in a W B0 or W list the first command."""
        if step not in order.W_SLOT_STEPS:
            return None
        commits = [i for i, c in enumerate(cmds) if isinstance(c, schedule.CommitP2P)]
        return commits[1] if step == order.B1_W_F1 else commits[0]


class DualPipeVZeroBubbleEngine(DeferredWeightGradSteps, AsyncSendDualPipeVEngine):
    """DeepSpeed's DualPipeV engine running :class:`DualPipeVZeroBubbleSchedule`, with DualPipeV's async sends
    (``pipeline_parallel.p2p``).  Never constructed: ``install(engine, queue)`` turns a built ``DualPipeVEngine``
    into one (deepspeed.initialize builds the engine itself) and attaches the queue that the layers defer their weight
    gradients to (one queue for both of the rank's stages)."""

    def _train_schedule(self):
        return DualPipeVZeroBubbleSchedule(
            micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id
        )

    def _exec_backward_pass(self, buffer_id, phase):
        super()._exec_backward_pass(buffer_id, phase)
        self.weight_grad_queue.seal()

    _INSTRUCTION_MAP = {
        **AsyncSendDualPipeVEngine._INSTRUCTION_MAP,
        **DeferredWeightGradSteps.INSTRUCTIONS,
        schedule.BackwardPass: _exec_backward_pass,
    }
