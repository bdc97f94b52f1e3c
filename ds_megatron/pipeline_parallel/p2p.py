"""Pipeline sends that do not wait for the receiver, for every schedule ds_megatron runs.

DeepSpeed 0.19's pipeline p2p (``deepspeed.runtime.pipe.p2p.send``) calls a blocking ``send``, and with gloo a send
returns only once the receiving rank has posted its matching receive (measured: a 4 KB-4 MB send from a rank whose
peer sleeps 0.5 s before its receive blocks the whole 0.5 s).  A stage that runs ahead of its peer (ZB-H2's extra
warm-up forwards, ZB-H1's W passes while the peer computes, DualPipeV's two phases) then stalls in each send
instead of moving on to its next pass.  DeepSpeed's DualPipeV batches its sends and receives
(``batch_isend_irecv``) but waits for the whole batch at each ``CommitP2P``: its sends block the same way.  (NCCL's
send does not block the host; Megatron-LM issues isend/irecv.  It does hold back, until the peer receives it, every
later operation between the two ranks: ``pipeline_parallel.rendezvous`` checks every schedule's order against that, as
:meth:`AsyncSendSteps.p2p_posts` derives it from the instructions the engine runs.)

:class:`PendingSends` is the one owner of an async send and of its wait.  Each send is an ``isend`` whose handle is
kept with a second reference to the tensor's storage (``detach()``: DeepSpeed's receive of the gradient of a
TP-partitioned activation reassigns the sent activation's ``.data``, which alone would free the storage the
transport still reads; tested: without it the receiver gets garbage).  Receives stay
blocking: the pass after them needs the data.  When a send is waited for: at the end of the step's pipeline work,
never earlier.  No tensor the engines send is written again while it is in flight: each is a fresh tensor (a
forward's output, an input's gradient, a new shape-metadata buffer; the receivers copy out of their reused receive
buffers), so nothing forces an earlier wait.  The wait-all runs at the step's first reduction (``ReduceTiedGrads``,
before the tied, SP-replicated and data-parallel reductions and the optimizer; a benchmark timing that instruction
counts the wait as idle, as a blocked send was) and after every schedule (eval has no reductions), so no send of one
step is still pending in the next.  A send already completed is dropped at each new send (NCCL reports completion;
gloo's ``is_completed()`` stays False until ``wait()``, so on gloo a step's sends are held until its end: the sent
activations, which the stage keeps for its backward anyway, and the sent input gradients).  Send order on each link
is the order of the calls, as DeepSpeed's (the receiver matches them in order): the shape metadata that the
engine's first send (every send under ``dynamic_shape``) carries (``_send_tensor_meta``) goes through the same
queue, before the tensors it describes.

:class:`AsyncSendSteps` puts it into DeepSpeed's engines without forking their send code: each send instruction runs
DeepSpeed's own (shape metadata, partitioned tensors, the bool-mask cast) with its module function ``p2p.send`` bound
to :meth:`PendingSends.isend` for the duration of the instruction (the engine has no other hook: its send code
calls that module function), and DualPipeV's commit waits for its receives only.  1F1B and DualPipeV install
:class:`AsyncSendPipelineEngine` and :class:`AsyncSendDualPipeVEngine` (their records name them); the zero-bubble
engines (``pipeline_parallel.zero_bubble``, ``pipeline_parallel.dualpipev_zb``) derive from them, so every schedule
is compared with the same p2p.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import p2p as ds_p2p
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine
from deepspeed.runtime.pipe.engine import PipelineEngine

from ds_megatron.pipeline_parallel import rendezvous


class PendingSends:
    """Sends in flight: (handle, the sent storage) per ``isend``, waited for by :meth:`wait_all`."""

    def __init__(self) -> None:
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self._pending)

    def _keep(self, work, tensor: torch.Tensor) -> None:
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        self._pending.append((work, tensor.detach()))

    def isend(self, tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
        """Start sending ``tensor`` to global rank ``dst``; return at once (the receiver need not be there)."""
        self._keep(dist.isend(tensor, dst, group=group, tag=tag), tensor)

    def commit(self, ops: list) -> None:
        """Start a batch of DeepSpeed ``P2POp``s (``op`` is "isend" or "irecv") as ``batch_isend_irecv`` and return
        once its receives have arrived; its sends stay pending.  A backend that coalesces the batch into one
        handle (NCCL) is waited for whole: there ``wait()`` holds back the GPU stream, not the host."""
        if not ops:
            return
        torch_ops = [dist.P2POp(getattr(dist, op.op), op.tensor, op.peer, op.group, op.tag) for op in ops]
        works = dist.batch_isend_irecv(torch_ops)
        if len(works) != len(ops):
            for work in works:
                work.wait()
            return
        for op, work in zip(ops, works):
            if op.op == "isend":
                self._keep(work, op.tensor)
            else:
                work.wait()

    def wait_all(self) -> None:
        """Wait until every pending send has completed (the receivers have them), oldest first."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()


class BlockingSends(PendingSends):
    """The sends as DeepSpeed 0.19 makes them, for measuring what async sends change (the benchmarks swap it in
    for an engine's ``pending_sends``): each send returns once its receiver has posted the receive, each DualPipeV
    commit once its whole batch is done."""

    def isend(self, tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
        dist.send(tensor, dst, group=group, tag=tag)

    def commit(self, ops: list) -> None:
        super().commit(ops)
        PendingSends.wait_all(self)


class AsyncSendSteps:
    """The send, commit and end-of-step instructions of an engine whose sends are async, mixed in before DeepSpeed's
    engine class (``PipelineEngine`` or ``DualPipeVEngine``; each engine class lists them in its
    ``_INSTRUCTION_MAP``)."""

    pending_sends: PendingSends | None = None  # the engine's sends in flight, set by ``install``

    @contextlib.contextmanager
    def _sends_async(self):
        """DeepSpeed's ``p2p.send(tensor, stage)`` as :meth:`PendingSends.isend` while the block runs."""
        grid, pending = self.grid, self.pending_sends

        def send(tensor, dest_stage, async_op=False):
            pending.isend(tensor, grid.stage_to_global(stage_id=dest_stage))

        blocking, ds_p2p.send = ds_p2p.send, send
        try:
            yield
        finally:
            ds_p2p.send = blocking

    def _exec_send_activations(self, *args, **kwargs):
        with self._sends_async():
            super()._exec_send_activations(*args, **kwargs)

    def _exec_send_grads(self, *args, **kwargs):
        with self._sends_async():
            super()._exec_send_grads(*args, **kwargs)

    def _exec_commit_p2p(self):
        self.pending_sends.commit(self._p2p_ops)
        self._p2p_ops = []

    def _exec_reduce_tied_grads(self):
        self.pending_sends.wait_all()
        super()._exec_reduce_tied_grads()

    def _exec_schedule(self, pipe_schedule):
        super()._exec_schedule(pipe_schedule)
        self.pending_sends.wait_all()

    INSTRUCTIONS = {  # merged into each engine's _INSTRUCTION_MAP
        schedule.SendActivation: _exec_send_activations,
        schedule.SendGrad: _exec_send_grads,
        schedule.ReduceTiedGrads: _exec_reduce_tied_grads,
    }

    # DeepSpeed's p2p instructions: (send or receive, the peer's stage offset in phase 0, what they carry).
    # Phase 1 (DualPipeV's way back) flows the other way.
    P2P_INSTRUCTIONS = {
        schedule.SendActivation: (rendezvous.SEND, +1, "act"),
        schedule.RecvActivation: (rendezvous.RECV, -1, "act"),
        schedule.SendGrad: (rendezvous.SEND, -1, "grad"),
        schedule.RecvGrad: (rendezvous.RECV, +1, "grad"),
    }

    @classmethod
    def p2p_posts(cls, pipe_schedule) -> list[rendezvous.Batch]:
        """The p2p operations an engine of this class posts while it runs ``pipe_schedule`` (its instructions, in
        order), peers as stage ids, for ``pipeline_parallel.rendezvous``.  Each send is an isend nobody waits for until
        the step's end; the first activation sent on each link carries the shape metadata first (an isend too; its
        receive blocks).  1F1B's engine receives with a blocking ``recv`` at each receive instruction;
        DualPipeV's queues every send and receive until the next commit and posts them as one
        ``batch_isend_irecv``, which NCCL returns as one handle, so :meth:`PendingSends.commit` waits for all of
        it.  A message is (kind, micro-batch count on its link) under 1F1B, (kind, pipe buffer) under DualPipeV,
        whose buffers (phase * m + micro-batch) are numbered alike on every rank."""
        batched = issubclass(cls, DualPipeVEngine)
        stage, posts, queued, counts, meta_sent, meta_received = pipe_schedule.stage_id, [], [], {}, set(), set()
        for cmds in pipe_schedule.steps():
            for cmd in cmds:
                if isinstance(cmd, schedule.CommitP2P) and queued:
                    posts.append(rendezvous.Batch(tuple(queued), wait="all", batched=True))
                    queued = []
                if type(cmd) not in cls.P2P_INSTRUCTIONS:
                    continue
                kind, offset, carries = cls.P2P_INSTRUCTIONS[type(cmd)]
                phase = getattr(cmd, "phase", 0)
                peer = stage + (offset if phase == 0 else -offset)
                if batched:
                    message = (carries, cmd.buffer_id)
                else:
                    message = (carries, counts.setdefault((kind, carries), 0))
                    counts[(kind, carries)] += 1
                if carries == "act" and kind == rendezvous.SEND and (peer not in meta_sent):
                    meta_sent.add(peer)
                    posts.append(rendezvous.send(peer, ("meta", phase)))
                if carries == "act" and kind == rendezvous.RECV and (peer not in meta_received):
                    meta_received.add(peer)
                    posts.append(rendezvous.recv(peer, ("meta", phase)))
                if batched:
                    queued.append(rendezvous.Op(kind, peer, message))
                elif kind == rendezvous.SEND:
                    posts.append(rendezvous.send(peer, message))
                else:
                    posts.append(rendezvous.recv(peer, message))
        return posts

    @classmethod
    def install(cls, engine, *args) -> None:
        """Turn ``engine``, built by ``deepspeed.initialize`` as an instance of ``cls``'s DeepSpeed base class, into
        a ``cls``; ``args`` go to ``cls._attach``."""
        base = cls.DEEPSPEED_ENGINE
        if type(engine) is not base:
            raise TypeError(f"{cls.__name__} extends DeepSpeed's {base.__name__}, not {type(engine).__name__}")
        engine.__class__ = cls
        engine.pending_sends = PendingSends()
        cls._attach(engine, *args)

    @classmethod
    def _attach(cls, engine) -> None:
        """What a subclass attaches to the engine besides its pending sends (the zero-bubble ones: their queue)."""


class AsyncSendPipelineEngine(AsyncSendSteps, PipelineEngine):
    """DeepSpeed's 1F1B engine with async sends.  Never constructed: ``install`` turns a built one into
    it."""

    DEEPSPEED_ENGINE = PipelineEngine
    _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, **AsyncSendSteps.INSTRUCTIONS}


class AsyncSendDualPipeVEngine(AsyncSendSteps, DualPipeVEngine):
    """DeepSpeed's DualPipeV engine with async sends: each commit waits for its receives only."""

    DEEPSPEED_ENGINE = DualPipeVEngine
    _INSTRUCTION_MAP = {
        **DualPipeVEngine._INSTRUCTION_MAP,
        **AsyncSendSteps.INSTRUCTIONS,
        schedule.CommitP2P: AsyncSendSteps._exec_commit_p2p,
    }
