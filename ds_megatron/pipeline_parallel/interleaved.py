"""L3.5: interleaved 1F1B (``interleaved-1f1b``, ``ds_megatron.parallel.virtual_stages`` v) on DeepSpeed's engine.

The layers are cut into v p stages (``module.stage_parts``, as for 1F1B, over v p parts); pipeline rank r builds
stages r, r + p, ..., r + (v - 1) p ("chunks" 0 .. v - 1 of the rank), so rank 0 holds the embedding and rank p - 1
the output layer and the loss, as under 1F1B (a tied embedding keeps DeepSpeed's tied-gradient exchange between
them).  The order of passes and p2p batches is ``interleaved_order.rank_program``'s.

What is DeepSpeed's and what is not (deepspeed 0.19.8):
- :class:`InterleavedModel` is DeepSpeed's ``PipelineModule`` built v times over, as DeepSpeed's ``DualPipeVModule``
  builds its two stages: ``_partition_layers`` over v p parts (``PipelineModel``'s, from the one table of stage
  boundaries), ``_build`` once per chunk, ``forward_funcs`` (and
  ds_megatron's recompute segments) swapped per chunk (``activate_phase``), ``stage_owner`` mapping stage s to rank
  s mod p so that the tied embedding's group is ranks 0 and p - 1.
- :class:`InterleavedEngine` is DeepSpeed's ``DualPipeVEngine``'s instruction set reused as it is: one buffer slot
  per (chunk, micro-batch), one shape exchange per chunk, sends and receives queued per chunk and posted by
  ``CommitP2P`` as one ``batch_isend_irecv`` (which, unlike DeepSpeed's blocking ``p2p.send``, reaches rank 0 from
  rank p - 1 with the same code), the loss kept per buffer on the loss stage; with ds_megatron's async sends
  (``pipeline_parallel.p2p``: each commit waits for its receives only).  What DualPipeV has that interleaving has
  not is switched off by overriding the methods that carry it: the turn-around on the last rank, the loss on rank
  0's phase 1, the labels moved to phase 1's buffer.  The engine class is swapped in after
  ``deepspeed.initialize`` (which builds a ``PipelineEngine`` for this module), as every schedule's is.
- The schedule (:class:`InterleavedSchedule`) is new: DeepSpeed has no interleaved order.
- ``interleaved-zb`` (:class:`InterleavedZeroBubbleEngine`) adds ds_megatron's weight-gradient split
  (``zero_bubble.DeferredWeightGradSteps``, as ``dualpipev-zb`` adds it to DualPipeV) and runs the W passes where
  ``interleaved_order.deferred_w_timeline`` places them.
"""

from __future__ import annotations

from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.dualpipev import _INIT, DualPipeVEngine
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule

from ds_megatron.pipeline_parallel import rendezvous
from ds_megatron.pipeline_parallel.module import PipelineModel
from ds_megatron.pipeline_parallel.p2p import AsyncSendSteps
from ds_megatron.pipeline_parallel.schedules import interleaved_order as order
from ds_megatron.pipeline_parallel.zero_bubble import DeferredWeightGradSteps, WeightGradPass


class InterleavedModel(PipelineModel):
    """:class:`PipelineModel` cut into v p stages, v per rank (stages r + c p, c < v).  Only one chunk is the
    module's forward at a time (:meth:`activate_phase`, DeepSpeed's name for it); recompute segments are per chunk,
    each chunk recomputed as 1F1B recomputes a stage of its own."""

    def __init__(self, *args, virtual_stages: int, **kwargs):
        # read by _partition_layers, which PipelineModule.__init__ calls before nn.Module has its attribute tables
        object.__setattr__(self, "virtual_stages", virtual_stages)
        object.__setattr__(self, "chunk_segments", None)
        super().__init__(*args, **kwargs)
        segments = []
        for chunk in range(self.virtual_stages):
            self.activate_phase(chunk)
            segments.append(self._segments())
        self.chunk_segments = segments
        self.activate_phase(0)

    def _partition_layers(self, method="uniform"):
        self.pipeline_ranks = self.num_stages
        self.num_stages *= self.virtual_stages
        super()._partition_layers(method)
        p, r = self.pipeline_ranks, self.stage_id
        self.chunk_bounds = [
            (self.parts[order.stage_of(r, c, p)], self.parts[order.stage_of(r, c, p) + 1])
            for c in range(self.virtual_stages)
        ]

    def stage_owner(self, layer_idx):
        """The pipeline rank that builds ``layer_idx``."""
        return order.rank_of(super().stage_owner(layer_idx), self.pipeline_ranks)

    def _build(self):
        self.chunk_funcs = []
        for start, stop in self.chunk_bounds:
            self._set_bounds(start, stop)
            super()._build()
            self.chunk_funcs.append(self.forward_funcs)
            self.forward_funcs = []
        self.activate_phase(0)

    def activate_phase(self, chunk: int) -> None:
        """Expose the layers of local ``chunk`` as this module's forward."""
        self.active_chunk = chunk
        self.forward_funcs = self.chunk_funcs[chunk]
        self._local_start, self._local_stop = self.chunk_bounds[chunk]
        if self.chunk_segments is not None:  # None while PipelineModel builds the chunks
            self.segments = self.chunk_segments[chunk]

    def save_state_dict(self, *args, **kwargs):
        for chunk in range(self.virtual_stages):
            self.activate_phase(chunk)
            PipelineModule.save_state_dict(self, *args, **kwargs)
        self.activate_phase(0)

    def load_state_dir(self, *args, **kwargs):
        for chunk in range(self.virtual_stages):
            self.activate_phase(chunk)
            PipelineModule.load_state_dir(self, *args, **kwargs)
        self.activate_phase(0)


_SEND_RECV = {  # (direction, what) of an order's p2p op -> DeepSpeed's instruction, and whose chunk's buffer it uses
    ("send", order.ACT): (schedule.SendActivation, "src"),
    ("recv", order.ACT): (schedule.RecvActivation, "dst"),
    ("send", order.GRAD): (schedule.SendGrad, "src"),
    ("recv", order.GRAD): (schedule.RecvGrad, "dst"),
}


class InterleavedSchedule(schedule.PipeSchedule):
    """Rank ``stage_id``'s :func:`interleaved_order.rank_program` as DeepSpeed instructions: a pass is its
    ``ForwardPass``/``BackwardPass`` on buffer c m + mb with ``phase`` c (the local chunk), the first stage's and the
    loss stage's forwards load their micro-batch first; a p2p batch is its sends and receives, then ``CommitP2P``.
    With ``deferred_w`` each backward is B only and a W pass is a ``WeightGradPass`` where the order places it.  The
    step ends with DeepSpeed's reductions and optimizer step."""

    def __init__(self, micro_batches, stages, stage_id, virtual_stages, forward_only=False, deferred_w=False):
        super().__init__(micro_batches, stages, stage_id)
        self.virtual_stages, self.forward_only, self.deferred_w = virtual_stages, forward_only, deferred_w
        # checked here (the config refuses it first): the order walks micro-batches in groups of p
        order.rank_passes(stages, virtual_stages, micro_batches, stage_id, forward_only)

    def num_pipe_buffers(self):
        """One slot per (chunk, micro-batch): ``chunk * micro_batches + micro_batch``."""
        return self.virtual_stages * self.micro_batches

    def _buffer(self, chunk: int, mb: int) -> int:
        return chunk * self.micro_batches + mb

    def steps(self):
        p, v, m, rank = self.stages, self.virtual_stages, self.micro_batches, self.stage_id
        for item in order.rank_program(p, v, m, rank, self.forward_only, self.deferred_w):
            if item[0] == order.COMM:
                cmds = []
                for direction, what, src, dst, mb in item[1]:
                    instruction, side = _SEND_RECV[(direction, what)]
                    chunk = (src if side == "src" else dst) // p
                    cmds.append(instruction(self._buffer(chunk, mb), phase=chunk))
                yield [*cmds, schedule.CommitP2P()]
                continue
            kind, chunk, mb = item
            if kind == order.WEIGHT:  # the oldest queued W pass: the order queues and runs them oldest first
                yield [WeightGradPass()]
                continue
            buffer_id = self._buffer(chunk, mb)
            if kind == order.FORWARD:
                loads = (rank == 0 and chunk == 0) or (rank == p - 1 and chunk == v - 1)
                yield [schedule.LoadMicroBatch(buffer_id)] * loads + [schedule.ForwardPass(buffer_id, phase=chunk)]
            else:
                yield [schedule.BackwardPass(buffer_id, phase=chunk)]
        if not self.forward_only:
            yield [schedule.ReduceTiedGrads(), schedule.ReduceGrads(), schedule.OptimizerStep()]


class InterleavedEngine(AsyncSendSteps, DualPipeVEngine):
    """DeepSpeed's ``DualPipeVEngine`` instructions over v chunks per rank, with async sends, running
    :class:`InterleavedSchedule`.  Never constructed: :meth:`install` turns the ``PipelineEngine`` that
    ``deepspeed.initialize`` built for an :class:`InterleavedModel` into one."""

    DEEPSPEED_ENGINE = PipelineEngine

    @classmethod
    def _attach(cls, engine) -> None:
        """The state DualPipeVEngine's constructor would have set, per chunk instead of per phase."""
        if not isinstance(engine.module, InterleavedModel):
            raise TypeError(f"{cls.__name__} runs an InterleavedModel, not {type(engine.module).__name__}")
        for flag in ("is_pipe_partitioned", "is_grad_partitioned", "dynamic_shape", "has_attention_mask"):
            if getattr(engine, flag):
                raise ValueError(f"{cls.__name__} sends whole boundary tensors with fixed shapes ({flag} is set)")
        engine.virtual_stages = engine.module.virtual_stages
        engine._active_phase = None
        engine._p2p_ops = []
        engine.reset_activation_shape()
        engine.pipe_buffers["grads"] = []
        engine.pipe_buffers["losses"] = []

    def reset_activation_shape(self):
        PipelineEngine.reset_activation_shape(self)
        self._first_send = [True] * self.virtual_stages
        self._recv_specs = [None] * self.virtual_stages

    def is_first_stage(self):
        """Rank 0; within a pass, only its chunk 0 (the embedding)."""
        return self.stage_id == 0 and self._active_phase in (None, _INIT, 0)

    def is_last_stage(self):
        """Rank p - 1; within a pass, only its chunk v - 1 (the output layer and the loss)."""
        last_rank = self.stage_id == self.num_stages - 1
        if self._active_phase in (None, _INIT):
            return last_rank
        return last_rank and self._active_phase == self.virtual_stages - 1

    def _is_loss_stage(self, phase):
        return self.stage_id == self.num_stages - 1 and phase == self.virtual_stages - 1

    def _is_last_rank(self):
        return False  # no turn-around: the last rank's chunks send on to rank 0 like any other

    def _loss_stage_global_rank(self):
        return PipelineEngine._loss_stage_global_rank(self)

    def _downstream_stage(self, phase):
        return (self.stage_id + 1) % self.num_stages

    def _upstream_stage(self, phase):
        return (self.stage_id - 1) % self.num_stages

    def _train_schedule(self):
        return InterleavedSchedule(self.micro_batches, self.num_stages, self.stage_id, self.virtual_stages)

    def _inference_schedule(self, micro_batches):
        return InterleavedSchedule(micro_batches, self.num_stages, self.stage_id, self.virtual_stages, True)

    _INSTRUCTION_MAP = {
        **DualPipeVEngine._INSTRUCTION_MAP,
        **AsyncSendSteps.INSTRUCTIONS,
        schedule.LoadMicroBatch: PipelineEngine._exec_load_micro_batch,  # labels stay in the loss chunk's buffer
        schedule.CommitP2P: AsyncSendSteps._exec_commit_p2p,
    }

    @classmethod
    def p2p_posts(cls, pipe_schedule: InterleavedSchedule) -> list[rendezvous.Batch]:
        """The p2p operations this engine posts while it runs ``pipe_schedule`` (its instructions, in order), peers
        as pipeline ranks: a shape message an isend (sent at its chunk's first activation send) or a blocking receive
        (at the first receive); each commit one ``batch_isend_irecv`` whose receives it waits for.  A message is
        (what, sending stage, receiving stage, micro-batch), which names it alike on both ranks."""
        p, m, rank = pipe_schedule.stages, pipe_schedule.micro_batches, pipe_schedule.stage_id
        posts, queued, meta_sent, meta_received = [], [], set(), set()
        for cmds in pipe_schedule.steps():
            for cmd in cmds:
                if isinstance(cmd, schedule.CommitP2P):
                    posts.append(rendezvous.Batch(tuple(queued), wait="recv", batched=True))
                    queued = []
                    continue
                sends = isinstance(cmd, schedule.SendActivation | schedule.SendGrad)
                if not sends and not isinstance(cmd, schedule.RecvActivation | schedule.RecvGrad):
                    continue
                chunk, mb = cmd.phase, cmd.buffer_id % m
                act = isinstance(cmd, schedule.SendActivation | schedule.RecvActivation)
                stage = order.stage_of(rank, chunk, p)
                peer_stage = stage + (1 if act == sends else -1)
                peer = order.rank_of(peer_stage, p)
                src, dst = (stage, peer_stage) if sends else (peer_stage, stage)
                message = (order.ACT if act else order.GRAD, src, dst, mb)
                if act and sends and src not in meta_sent:
                    meta_sent.add(src)
                    posts.append(rendezvous.send(peer, ("meta", src)))
                if act and not sends and src not in meta_received:
                    meta_received.add(src)
                    posts.append(rendezvous.recv(peer, ("meta", src)))
                queued.append(rendezvous.Op(rendezvous.SEND if sends else rendezvous.RECV, peer, message))
        return posts


class InterleavedZeroBubbleEngine(DeferredWeightGradSteps, InterleavedEngine):
    """:class:`InterleavedEngine` running the order with deferred W passes (``interleaved-zb``): each backward pass
    seals its W pass in the rank's queue (one queue for all of its chunks) and ``WeightGradPass`` runs the oldest,
    with the step guards every zero-bubble engine shares (``zero_bubble.DeferredWeightGradSteps``).  Never
    constructed: ``install(engine, queue)`` turns the built ``PipelineEngine`` into one."""

    @classmethod
    def _attach(cls, engine, queue) -> None:
        InterleavedEngine._attach.__func__(cls, engine)
        engine.weight_grad_queue = queue

    def _train_schedule(self):
        return InterleavedSchedule(
            self.micro_batches, self.num_stages, self.stage_id, self.virtual_stages, deferred_w=True
        )

    def _exec_backward_pass(self, buffer_id, phase):
        super()._exec_backward_pass(buffer_id, phase)
        self.weight_grad_queue.seal()

    _INSTRUCTION_MAP = {
        **InterleavedEngine._INSTRUCTION_MAP,
        **DeferredWeightGradSteps.INSTRUCTIONS,
        schedule.BackwardPass: _exec_backward_pass,
    }
