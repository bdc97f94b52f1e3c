"""ZB-H1 and ZB-H2 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 3.1) on DeepSpeed's pipeline engine.

DeepSpeed's 1F1B (``TrainSchedule``) runs each backward pass whole.  With the layers' weight gradients deferred
(``ds_megatron.tensor_parallel.weight_grad``), a backward pass is B only (input gradients: what the previous stage waits
for), and each W pass (weight gradients: nobody waits for them before the step) becomes an instruction of its own,
:class:`WeightGradPass`.  :class:`ZeroBubbleH1Schedule` yields DeepSpeed's 1F1B order unchanged and inserts the W passes
(the order ``schedules.zb_order.zb_h1_streams`` builds): stage s holds back up to s of them (the last stage the most),
runs one whenever it holds more, and runs the rest at the end of the step, where its upstream stages are still busy with
their last B passes (the cooldown bubble of 1F1B).  The number of micro-batches in flight is 1F1B's; stage s
additionally keeps what at most s W passes need whenever it runs a forward (s + 1 in the cooldown, between a backward
and the send of its gradient, when that backward has just freed its activations): each linear's input and output
gradient.  With at most p - s micro-batches in flight, that stays below the p micro-batches 1F1B's first stage holds, so
the peak over stages is 1F1B's (the first stage holds none back).  With T_F = T_B = T_W the bubble falls from
(p-1)(T_F+T_B+T_W) to (p-1)(T_F+T_B-T_W) per step.

:class:`ZeroBubblePipelineEngine` executes it: each backward pass seals its W pass in the stage's queue; a
``WeightGradPass`` runs the oldest one; ``ReduceTiedGrads`` (the first of the step's reduction instructions) runs
any left first, so the tied, SP-replicated and data-parallel reductions, clipping, the skipped-step guard and the
optimizer step all see complete gradients; the optimizer step refuses to run with W passes still queued.

:class:`ZeroBubbleH2Schedule` yields the ZB-H2 order of ``schedules.zb_order`` (up to 2(p - s) - 1 forwards ahead,
W passes where the stage would wait; ZB-H1's order where that is as fast under the costs) and
:class:`ZeroBubbleH2PipelineEngine` runs it, rebuilding the order once for the pass costs it times in the first
step.
"""

from __future__ import annotations

import statistics
import time

import torch
from deepspeed.runtime.pipe import schedule

from ds_megatron.pipeline_parallel.p2p import AsyncSendPipelineEngine
from ds_megatron.pipeline_parallel.schedules.zb_order import BUILD_COSTS, num_buffers, zb_h1_streams, zb_h2_streams


class WeightGradPass(schedule.PipeInstruction):
    """Run the oldest deferred W pass of this stage (its weight gradients, accumulated into the gradients)."""


KINDS = {  # zb_order's op kinds -> DeepSpeed's instructions
    "LOAD": schedule.LoadMicroBatch,
    "F": schedule.ForwardPass,
    "B": schedule.BackwardPass,
    "SA": schedule.SendActivation,
    "RA": schedule.RecvActivation,
    "SG": schedule.SendGrad,
    "RG": schedule.RecvGrad,
}


def instructions(ops: tuple[tuple, ...], buffers: int):
    """A stage's ``zb_order`` ops as DeepSpeed steps, one instruction each (micro-batch i in pipe buffer
    i % ``buffers``), then the step's reductions and optimizer step."""
    for op in ops:
        yield [WeightGradPass()] if op[0] == "W" else [KINDS[op[0]](op[1] % buffers)]
    yield [schedule.ReduceTiedGrads(), schedule.ReduceGrads(), schedule.OptimizerStep()]


class ZeroBubbleH1Schedule(schedule.TrainSchedule):
    """DeepSpeed's 1F1B with W passes split off the backward passes and delayed by up to ``stage_id`` of them: the
    order of ``zb_order.zb_h1_streams`` (which says where each W goes and why), in 1F1B's pipe buffers.  With
    T_F = T_B = T_W this reaches ZB-H1's bubble of (p-1)(T_F+T_B-T_W) under the engines' async sends
    (``pipeline_parallel.p2p``; tests/unit/test_zero_bubble.py times it)."""

    def steps(self):
        ops = zb_h1_streams(self.stages, self.micro_batches)[self.stage_id]
        yield from instructions(ops, self.num_pipe_buffers())


class ZeroBubbleH2Schedule(schedule.PipeSchedule):
    """ZB-H2 (``schedules.zb_order``): up to 2(p - s) - 1 forwards ahead on stage s and the W passes where the
    stage would wait, built for ``costs`` (T_F, T_B, T_W), or ZB-H1's order where that is as fast under those
    costs, as DeepSpeed instructions, one per step; micro-batch i lives in pipe buffer i % :meth:`num_pipe_buffers`."""

    def __init__(self, micro_batches, stages, stage_id, costs: tuple = BUILD_COSTS):
        super().__init__(micro_batches, stages, stage_id)
        self.ops = zb_h2_streams(stages, micro_batches, costs)[stage_id]
        self.buffers = num_buffers(self.ops)

    def steps(self):
        yield from instructions(self.ops, self.buffers)

    def num_pipe_buffers(self):
        return self.buffers


class DeferredWeightGradSteps:
    """The instructions every engine with deferred weight gradients runs the same way (ZB-H1, ZB-H2 and DualPipeV's
    ``pipeline_parallel.dualpipev_zb``), mixed in before DeepSpeed's engine class: a W pass runs the oldest queued
    one, the step's first reduction (``ReduceTiedGrads``) runs every one left first, so the tied, SP-replicated and
    data-parallel reductions, clipping, the skipped-step guard and the optimizer see complete gradients, and an
    optimizer step with W passes still queued is an error."""

    weight_grad_queue = None  # the rank's ``WeightGradQueue``, set by the engine's ``install``
    # told before and after each W pass (after its gradients reached the BF16 optimizer's fp32 buffers): the
    # overlapped data-parallel reduction (``grad_reduce.GradReduceOverlap``), None without it
    grad_pass_observer = None

    @classmethod
    def _attach(cls, engine, queue) -> None:
        """``install``'s part: the queue that the layers defer their weight gradients to."""
        engine.weight_grad_queue = queue

    def _exec_weight_grad_pass(self):
        self._run_weight_grads(all_of_them=False)

    def _run_weight_grads(self, all_of_them: bool) -> None:
        """Run the oldest W pass (or all).  The BF16 optimizer moves each backward's 16-bit gradients into its fp32
        accumulators right after it (and zeroes them before the next one); a W pass is treated the same way, so
        every gradient is added to the accumulators exactly once, in 16-bit as a backward pass leaves it."""
        queue = self.weight_grad_queue
        bf16 = bool(getattr(self, "using_bf16_optimizer", False))
        observer = self.grad_pass_observer
        while len(queue):
            if not queue.sealed:
                queue.seal()
            if bf16:
                self.optimizer.clear_lp_grads()
            if observer is not None:
                observer.begin_pass()
            queue.run_next()
            if bf16 and not self._config.bfloat16_config.immediate_grad_update:
                self.optimizer.update_hp_grads(clear_lp_grads=False)
            if observer is not None:
                observer.end_pass()
            if not all_of_them:
                return

    def _exec_reduce_tied_grads(self):
        self._run_weight_grads(all_of_them=True)
        super()._exec_reduce_tied_grads()

    def _exec_optimizer_step(self, lr_kwargs=None):
        if len(self.weight_grad_queue):
            raise RuntimeError(f"{len(self.weight_grad_queue)} W pass(es) still queued at the optimizer step")
        super()._exec_optimizer_step(lr_kwargs)

    INSTRUCTIONS = {  # merged into each engine's _INSTRUCTION_MAP
        schedule.ReduceTiedGrads: _exec_reduce_tied_grads,
        schedule.OptimizerStep: _exec_optimizer_step,
        WeightGradPass: _exec_weight_grad_pass,
    }


class ZeroBubblePipelineEngine(DeferredWeightGradSteps, AsyncSendPipelineEngine):
    """DeepSpeed's pipeline engine running :class:`ZeroBubbleH1Schedule`, with 1F1B's async sends
    (``pipeline_parallel.p2p``).  Never constructed: ``install(engine, queue)`` turns a built ``PipelineEngine``
    into one (deepspeed.initialize builds the engine itself) and attaches the queue that the layers defer their weight
    gradients to."""

    def _train_schedule(self):
        return ZeroBubbleH1Schedule(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id)

    def _exec_backward_pass(self, buffer_id):
        super()._exec_backward_pass(buffer_id)
        self.weight_grad_queue.seal()

    _grad_recv_buffer = None  # the tensor(s) DeepSpeed receives gradients into, reused for every micro-batch

    def _exec_recv_grads(self, buffer_id):
        # DeepSpeed receives every micro-batch's output gradient into one reused buffer (``grad_layer``); the
        # stage's last linear may keep that very tensor for its W pass, so each micro-batch gets its own copy, and
        # DeepSpeed gets its receive buffer back, never a copy a queued W pass still holds (which the next receive
        # would overwrite whenever a stage holds a W pass across a receive: ZB-H2, and ZB-H1 at pp > 2).
        self.grad_layer = self._grad_recv_buffer
        super()._exec_recv_grads(buffer_id)
        self._grad_recv_buffer = self.grad_layer
        if isinstance(self.grad_layer, tuple | list):
            self.grad_layer = type(self.grad_layer)(g.clone() if g.is_floating_point() else g for g in self.grad_layer)
        else:
            self.grad_layer = self.grad_layer.clone()

    _INSTRUCTION_MAP = {
        **AsyncSendPipelineEngine._INSTRUCTION_MAP,
        **DeferredWeightGradSteps.INSTRUCTIONS,
        schedule.BackwardPass: _exec_backward_pass,
        schedule.RecvGrad: _exec_recv_grads,
    }


class ZeroBubbleH2PipelineEngine(ZeroBubblePipelineEngine):
    """DeepSpeed's pipeline engine running :class:`ZeroBubbleH2Schedule`.  Where a W pass fits depends on what F,
    B and W cost (the paper's scheduler takes them profiled): the first step runs the order built for equal costs
    and times every F, B and W on every rank; each stage's medians (one all-reduce over all ranks, so every rank
    builds the same order: TP ranks of a stage must run the same passes) rebuild the order once, for the rest of
    the run.  Gradients do not depend on the order: each micro-batch's F and B are the same computations, and W
    passes add into the gradients in backward order whatever their place."""

    zb_costs: tuple = BUILD_COSTS  # one (T_F, T_B, T_W), or one per stage once the first step has timed them
    _zb_timing: dict | None = None  # kind -> seconds of each pass while the first step is timed

    def _train_schedule(self):
        if self._zb_timing is None and self.zb_costs == BUILD_COSTS:
            self._zb_timing = {"F": [], "B": [], "W": []}
        return ZeroBubbleH2Schedule(
            micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id, costs=self.zb_costs
        )

    def _timed(self, kind: str, run) -> None:
        if self._zb_timing is None:
            run()
            return
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        start = time.perf_counter()
        run()
        sync()
        self._zb_timing[kind].append(time.perf_counter() - start)

    def _exec_forward_pass(self, buffer_id):
        self._timed("F", lambda: super(ZeroBubbleH2PipelineEngine, self)._exec_forward_pass(buffer_id))

    def _exec_backward_pass(self, buffer_id):
        self._timed("B", lambda: super(ZeroBubbleH2PipelineEngine, self)._exec_backward_pass(buffer_id))

    def _exec_weight_grad_pass(self):
        self._timed("W", lambda: self._run_weight_grads(all_of_them=False))

    def _exec_optimizer_step(self, lr_kwargs=None):
        super()._exec_optimizer_step(lr_kwargs)
        if self._zb_timing is not None:
            self.zb_costs = agreed_costs(self._zb_timing, self.stage_id, self.num_stages, self.device)
            self._zb_timing = None


def agreed_costs(timing: dict, stage: int, num_stages: int, device: torch.device | str = "cpu") -> tuple:
    """Per stage (T_F, T_B, T_W): the median seconds of each kind of pass (robust to a pass the machine delayed),
    averaged over the stage's ranks (every rank adds its own to its stage's row of one all-reduce over all ranks, so
    every rank gets the same numbers and builds the same order), relative to the largest and rounded to 3
    significant digits; equal costs where a stage timed nothing.  The all-reduce runs on ``device``, the engine's
    (NCCL has no CPU tensors: "No backend type associated with device type cpu")."""
    table = torch.zeros(num_stages, 6, dtype=torch.float64)
    for i, kind in enumerate(("F", "B", "W")):
        if timing[kind]:
            table[stage, 2 * i] = statistics.median(timing[kind])
            table[stage, 2 * i + 1] = 1.0
    if torch.distributed.is_initialized():
        table = table.to(device)
        torch.distributed.all_reduce(table)
        table = table.cpu()
    means = table[:, 0::2] / table[:, 1::2].clamp(min=1.0)
    if not bool((means > 0).all()):
        return BUILD_COSTS
    means = means / means.max()
    return tuple(tuple(float(f"{float(v):.3g}") for v in row) for row in means)


ZeroBubbleH2PipelineEngine._INSTRUCTION_MAP = {
    **ZeroBubblePipelineEngine._INSTRUCTION_MAP,
    schedule.ForwardPass: ZeroBubbleH2PipelineEngine._exec_forward_pass,
    schedule.BackwardPass: ZeroBubbleH2PipelineEngine._exec_backward_pass,
    schedule.OptimizerStep: ZeroBubbleH2PipelineEngine._exec_optimizer_step,
    WeightGradPass: ZeroBubbleH2PipelineEngine._exec_weight_grad_pass,
}
