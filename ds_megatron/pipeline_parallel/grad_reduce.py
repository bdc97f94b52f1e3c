"""The data-parallel gradient reduction overlapped with the last backward work (``parallel.overlap_grad_reduce``).

DeepSpeed's pipeline engine reduces every gradient of a stage in its ``ReduceGrads`` instruction, after the last
micro-batch's backward pass (``PipelineEngine._exec_reduce_grads``: ``buffered_allreduce_fallback`` in buckets of
500M elements, blocking), so the whole reduction is exposed.  Here each parameter's gradient starts its all-reduce
(async, in buckets of :data:`BUCKET_ELEMENTS`) as soon as its last accumulation of the step is done, while the
backward of the layers before it still runs, and ``ReduceGrads`` only waits for the handles.

When is a gradient final?  A post-accumulate-grad hook fires on every parameter each time autograd adds to its
``.grad``.  The step's instruction stream is fixed by the schedule, so the first step of a stream records, per
parameter, the gradient pass (a ``BackwardPass``, or a W pass of deferred weight gradients) of its last firing and how
many times it fired in that pass; the next steps with the same stream call the gradient final at that firing.  This
covers every engine alike: the last backward of a stage, a parameter fired twice in one pass (a routed family's stage
runs one backward per floating boundary tensor), weight gradients deferred to W passes (zero-bubble schedules: the
last W pass, wherever it runs, also inside ``ReduceTiedGrads``), and two stages on one rank (DualPipeV, interleaved:
a stage's parameters are final after that stage's last pass).  A stream not seen before (the first step; ZB-H2's
rebuilt order) is learned again, its gradients reduced once the step's last gradient pass is done.  Expert
parameters (whose firing may depend on routing) and anything not known final are all-reduced right after that last
pass.  A gradient that arrives after its bucket's reduction started is an error, never a silent wrong sum.

What is the same as DeepSpeed, element for element: the sum runs in fp32 on DeepSpeed's data-parallel group with its
scaling (``DeepSpeedEngine.allreduce_bucket``: ``gradient_predivide_factor`` before, factor / dp after); on the BF16
optimizer the fp32 accumulation buffers are reduced (the 16-bit gradient of the final pass is added to them at its
final firing, the same addition DeepSpeed runs after the pass), never the bf16 gradients; expert parameters are
summed over their expert-data-parallel group and divided by dp x cp (``expert_parallel.layer.reduce_expert_grads``).
Tied weights shared across stages and, with the once-per-step SP sum, the SP-replicated parameters are summed over
their tied / TP group first (in ``ReduceTiedGrads``), so they are reduced after it, at ``ReduceGrads``, as DeepSpeed
does (reducing them earlier would change the order of the two sums, and the rounding).  Launches follow one bucket
order on every rank, so the collectives of each group match across ranks.

Not applied (DeepSpeed reduces, :func:`overlap_refusal` says why): ZeRO's optimizer (fp32 or fp16 with ZeRO >= 1
reduces into its own partitioned buckets, ``reduce_gradients``), the fp16 optimizer (16-bit gradients under loss
scaling), a ``communication_data_type`` other than fp32, and a data axis of one rank (nothing to reduce).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule

from ds_megatron.config.rules import GRAD_REDUCE_BUCKET_ELEMENTS as BUCKET_ELEMENTS  # read at use: tests shrink it


def overlap_refusal(engine) -> str | None:
    """Why the overlap cannot reduce ``engine``'s gradients exactly as DeepSpeed would (None: it can)."""
    if getattr(engine, "has_moe_layers", False):
        return "DeepSpeed's own MoE layers reduce their experts in its engine"
    if engine.zero_optimization() and not getattr(engine, "using_bf16_optimizer", False):
        return "ZeRO's optimizer reduces into its own partitioned buckets (reduce_gradients)"
    if engine.fp16_enabled():
        return "the fp16 optimizer keeps 16-bit gradients under loss scaling"
    if engine.communication_data_type != torch.float32:
        return f"communication_data_type is {engine.communication_data_type}; the overlap sums in fp32 only"
    return None


@dataclass
class _Bucket:
    params: list[torch.Tensor]
    group: object  # the process group it is summed over
    expert: bool  # expert rule (sum, then / divisor) instead of DeepSpeed's
    pending: int = 0  # parameters not yet final this step
    work: object = None
    flat: torch.Tensor | None = None
    grads: list[torch.Tensor] = field(default_factory=list)


class GradReduceOverlap:
    """One engine's overlapped reduction (built by :func:`install_grad_reduce_overlap`).

    ``late``: parameters reduced only at ``ReduceGrads`` (after their tied / SP sums); ``expert_group`` and
    ``expert_divisor``: the expert rule's group and divisor (ep > 1)."""

    def __init__(self, engine, late: list[torch.Tensor], expert_group=None, expert_divisor: int = 1):
        from deepspeed.moe.utils import is_moe_param

        self.engine = engine
        self.bf16 = bool(getattr(engine, "using_bf16_optimizer", False))
        self.dp_group = engine.mpu.get_data_parallel_group()
        self.dp = dist.get_world_size(self.dp_group)
        self.expert_group, self.expert_divisor = expert_group, expert_divisor
        self.hp_index: dict[int, tuple[int, int]] = {}  # BF16 optimizer: parameter -> (group, index) of its buffer
        if self.bf16:
            for i, group in enumerate(engine.optimizer.bf16_groups):
                for j, p in enumerate(group):
                    self.hp_index[id(p)] = (i, j)
        late_ids = {id(p) for p in late}
        params = [p for p in engine.module.parameters() if p.requires_grad and p.numel()]
        if self.bf16:
            params = [p for p in params if id(p) in self.hp_index]
        self.is_expert = {id(p): expert_group is not None and is_moe_param(p) for p in params}
        # reverse registration order: roughly the order backward finishes them; the experts last, in buckets of their
        # own (they start only once the step's last gradient pass is done, so between the others they would hold
        # back every bucket after them, and together they make one all-reduce over the expert-DP group per bucket)
        order = [p for p in reversed(params) if id(p) not in late_ids]
        early = self._bucketed([p for p in order if not self.is_expert[id(p)]])
        early += self._bucketed([p for p in order if self.is_expert[id(p)]])
        self.buckets = early + self._bucketed([p for p in reversed(params) if id(p) in late_ids])
        self.num_early = len(early)
        self.where = {id(p): k for k, b in enumerate(self.buckets) for p in b.params}
        self.learned: dict[int, tuple[int, int]] = {}  # parameter -> (gradient pass, firing in it) of its last firing
        self.learned_stream: tuple | None = None
        self.stream: tuple | None = None  # this step's instruction stream
        self.active = False  # inside a training step's schedule
        self.total_b = self.b_seen = 0
        self.pass_index = -1
        self.fired: dict[int, int] = {}  # firings per parameter in the current pass
        self.last: dict[int, tuple[int, int]] = {}  # this step's last firing per parameter (learning)
        self.ready: set[int] = set()
        self.next_launch = 0
        # buckets started this step before ReduceGrads, and of them inside a gradient pass (from a gradient's hook)
        self.launched_early = self.launched_in_pass = 0
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _bucketed(self, params: list[torch.Tensor]) -> list[_Bucket]:
        """Consecutive runs of ``params`` of one reduction rule, cut at :data:`BUCKET_ELEMENTS`."""
        buckets: list[_Bucket] = []
        size = 0
        for p in params:
            expert = self.is_expert[id(p)]
            if not buckets or buckets[-1].expert != expert or size + p.numel() > BUCKET_ELEMENTS:
                group = self.expert_group if expert else self.dp_group
                buckets.append(_Bucket([], group, expert))
                size = 0
            buckets[-1].params.append(p)
            size += p.numel()
        return buckets

    # ---- the step's events --------------------------------------------------------------------------------------

    def begin_step(self, steps: list[list]) -> None:
        self.total_b = sum(isinstance(cmd, schedule.BackwardPass) for cmds in steps for cmd in cmds)
        self.active = self.total_b > 0 and self.engine.pipeline_enable_backward_allreduce
        self.stream = tuple(repr(cmd) for cmds in steps for cmd in cmds)
        self.b_seen, self.pass_index, self.fired, self.last = 0, -1, {}, {}
        self.ready, self.next_launch, self.launched_early, self.launched_in_pass = set(), 0, 0, 0
        for b in self.buckets:
            b.pending, b.work, b.flat, b.grads = len(b.params), None, None, []

    @property
    def learning(self) -> bool:
        return self.stream != self.learned_stream

    def begin_pass(self, backward: bool = False) -> None:
        """Before a gradient pass (a ``BackwardPass``; a W pass when not ``backward``)."""
        self.pass_index += 1
        self.b_seen += backward
        self.fired = {}

    def end_pass(self) -> None:
        """After a gradient pass (on the BF16 optimizer, after its gradients were added to the fp32 buffers): once
        the step's last one is done, everything early is final."""
        queue = getattr(self.engine, "weight_grad_queue", None)
        if self.active and self.b_seen == self.total_b and not (queue is not None and len(queue)):
            for k in range(self.num_early):
                for p in self.buckets[k].params:
                    self._mark_ready(p)
            self._launch_in_order(early=True)

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.active:
            return
        pid = id(p)
        count = self.fired[pid] = self.fired.get(pid, 0) + 1
        k = self.where[pid]
        if self.buckets[k].work is not None:
            raise RuntimeError(
                "ds_megatron.parallel.overlap_grad_reduce: a gradient arrived after its data-parallel reduction had "
                f"started (parameter of shape {tuple(p.shape)}, gradient pass {self.pass_index}); set "
                "ds_megatron.parallel.overlap_grad_reduce false"
            )
        if self.learning:
            self.last[pid] = (self.pass_index, count)
            return
        if not self.is_expert[pid] and k < self.num_early and self.learned.get(pid) == (self.pass_index, count):
            self._mark_ready(p, in_pass=True)
            started = self.next_launch
            self._launch_in_order(early=True)
            self.launched_in_pass += self.next_launch - started

    def _mark_ready(self, p: torch.Tensor, in_pass: bool = False) -> None:
        """``p``'s gradient is final.  ``in_pass``: called from its hook, inside the pass, where on the BF16 optimizer
        the pass's 16-bit gradient is not yet in the fp32 buffer (DeepSpeed adds it after the pass; outside a pass
        it has been added already)."""
        pid = id(p)
        if pid in self.ready:
            return
        self.ready.add(pid)
        if in_pass and self.bf16 and p.grad is not None:  # the pass's 16-bit gradient into the fp32 buffer now
            i, j = self.hp_index[pid]
            self.engine.optimizer._update_hp_grad(p, i, j, clear_lp_grads=False)
            p.grad = None  # already added: DeepSpeed's update after the pass skips a parameter without one
        self.buckets[self.where[pid]].pending -= 1

    def _launch_in_order(self, early: bool) -> None:
        """Start every bucket whose parameters are all final, in bucket order (the same on every rank)."""
        end = self.num_early if early else len(self.buckets)
        while self.next_launch < end and self.buckets[self.next_launch].pending == 0:
            self._launch(self.buckets[self.next_launch])
            self.launched_early += early
            self.next_launch += 1

    # ---- the reduction ------------------------------------------------------------------------------------------

    def _grad(self, p: torch.Tensor) -> torch.Tensor:
        if self.bf16:
            i, j = self.hp_index[id(p)]
            return self.engine.optimizer.fp32_groups_gradients[i][j]
        if p.grad is None:  # every rank of the group sends every gradient, as DeepSpeed's own pass does
            p.grad = torch.zeros_like(p)
        return p.grad

    def _launch(self, b: _Bucket) -> None:
        b.grads = [self._grad(p) for p in b.params]
        # fp32 whatever the buffers hold (DeepSpeed's communication_data_type, which overlap_refusal requires fp32)
        flat = torch.cat([g.reshape(-1).float() for g in b.grads])
        if not b.expert:
            before, _ = self._deepspeed_scaling()
            if before is not None:
                flat.mul_(before)
        if dist.get_world_size(b.group) > 1 or not b.expert:
            b.work = dist.all_reduce(flat, group=b.group, async_op=True)
        else:
            b.work = _Done()
        b.flat = flat

    def _finish(self, b: _Bucket) -> None:
        b.work.wait()
        flat = b.flat
        if b.expert:
            flat.div_(self.expert_divisor)
        else:
            _, after = self._deepspeed_scaling()
            if after is not None:
                flat.mul_(after)
        offset = 0
        for g in b.grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        b.flat, b.grads = None, []

    def _deepspeed_scaling(self) -> tuple[float | None, float | None]:
        """The factors ``DeepSpeedEngine.allreduce_bucket`` multiplies by before and after its all-reduce."""
        engine = self.engine
        if not engine.gradient_average:
            return None, None
        if engine.postscale_gradients():
            pre = engine.gradient_predivide_factor()
            return (1.0 / pre if pre != 1.0 else None), (pre / self.dp if pre != self.dp else None)
        return 1.0 / self.dp, None

    def reduce_grads(self) -> None:
        """``ReduceGrads``: start what has not started (the late parameters last), then wait for every bucket."""
        for b in self.buckets[self.next_launch :]:
            for p in b.params:
                self._mark_ready(p)
        self._launch_in_order(early=False)
        for b in self.buckets:
            self._finish(b)
        if self.active and self.learning:
            self.learned, self.learned_stream = self.last, self.stream
        self.active = False


class _Done:
    """The handle of a reduction over a group of one rank (nothing to wait for)."""

    def wait(self) -> None:
        pass


class _Replay:
    """A pipeline schedule whose steps were listed ahead (DeepSpeed's ``_exec_schedule`` iterates it once)."""

    def __init__(self, pipe_schedule, steps: list[list]):
        self.pipe_schedule, self.steps = pipe_schedule, steps

    def num_pipe_buffers(self) -> int:
        return self.pipe_schedule.num_pipe_buffers()

    def __iter__(self):
        return iter(self.steps)


def install_grad_reduce_overlap(engine, late: list[torch.Tensor], expert_group=None, expert_divisor: int = 1):
    """Overlap ``engine``'s data-parallel reduction (see the module docstring): the schedule's stream is listed at
    the start of each step, each gradient pass (``BackwardPass``, a W pass) is framed, and ``ReduceGrads`` waits
    for the reductions.  Entries are the engine instance's own (its class's table stays as it is), on top of the
    ones installed before.  Returns the :class:`GradReduceOverlap`."""
    overlap = GradReduceOverlap(engine, late, expert_group, expert_divisor)
    table = dict(engine._INSTRUCTION_MAP)
    backward = table[schedule.BackwardPass]

    def backward_pass(self, **kwargs) -> None:
        overlap.begin_pass(backward=True)
        backward(self, **kwargs)
        overlap.end_pass()

    def reduce_grads(self) -> None:
        self._force_grad_boundary = True
        if self.pipeline_enable_backward_allreduce:
            overlap.reduce_grads()
        self._force_grad_boundary = False

    table.update({schedule.BackwardPass: backward_pass, schedule.ReduceGrads: reduce_grads})
    engine._INSTRUCTION_MAP = table
    run_schedule = type(engine)._exec_schedule

    def exec_schedule(self, pipe_schedule) -> None:
        steps = [list(cmds) for cmds in pipe_schedule]
        overlap.begin_step(steps)
        run_schedule(self, _Replay(pipe_schedule, steps))

    engine._exec_schedule = types.MethodType(exec_schedule, engine)
    engine.grad_pass_observer = overlap  # the W passes of deferred weight gradients (zero_bubble.py) report to it
    engine.grad_reduce_overlap = overlap
    return overlap
