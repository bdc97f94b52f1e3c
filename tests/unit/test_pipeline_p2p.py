"""Fast tier: the engines' pipeline sends do not wait for the receiver (``ds_megatron.pipeline_parallel.p2p``).

Two gloo ranks, no timing.  Rank 0 sends through the engine's own send instructions (DeepSpeed's code, with its
shape metadata) or DualPipeV's batched commit, then sends a flag with a plain blocking ``dist.send`` on another
tag; rank 1 receives the flag first and only then the tensors.  A send that waits for its receive (DeepSpeed's
``p2p.send``, DualPipeV's commit waiting for its whole batch) deadlocks here: both ranks then fail at the group's
timeout.  With async sends everything arrives intact, including a sent tensor whose ``.data`` the sender replaced
right after the send (DeepSpeed's partitioned receive does that); after the wait-all nothing is pending.  That
training is unchanged is shown by the launched parity runs (tests/launcher/test_parity.py,
tests/launcher/test_zero_bubble_launch.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import deepspeed.comm as ds_dist
import pytest
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import p2p as ds_p2p
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import TENSOR_META_SIZE, PipelineEngine
from inprocess import failures, run_checks, spawn_reports

from ds_megatron.config.schema import PIPELINE_SCHEDULES
from ds_megatron.pipeline_parallel.dualpipev_zb import DualPipeVZeroBubbleEngine
from ds_megatron.pipeline_parallel.interleaved import PIPELINE_SCHEDULE as INTERLEAVED
from ds_megatron.pipeline_parallel.interleaved import PIPELINE_SCHEDULE_ZB as INTERLEAVED_ZB
from ds_megatron.pipeline_parallel.interleaved import InterleavedEngine, InterleavedZeroBubbleEngine
from ds_megatron.pipeline_parallel.p2p import ENGINES as PLAIN_ENGINES
from ds_megatron.pipeline_parallel.p2p import (
    AsyncSendDualPipeVEngine,
    AsyncSendPipelineEngine,
    AsyncSendSteps,
    PendingSends,
)
from ds_megatron.pipeline_parallel.zero_bubble import ENGINES as ZERO_BUBBLE_ENGINES
from ds_megatron.tensor_parallel.weight_grad import WeightGradQueue

ENGINES = {  # as build_engine
    **PLAIN_ENGINES,
    **ZERO_BUBBLE_ENGINES,
    "dualpipev-zb": DualPipeVZeroBubbleEngine,
    INTERLEAVED: InterleavedEngine,
    INTERLEAVED_ZB: InterleavedZeroBubbleEngine,
}

SHAPE = (512, 1024)  # 2 MiB: above malloc's mmap threshold, so a storage freed while in flight is unmapped
FLAG_TAG = 1


def _activation() -> torch.Tensor:
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) / 7


def _bare(cls):
    """An engine of ``cls`` with only what its send instructions read: stage s is global rank s, one pipe buffer."""
    engine = object.__new__(cls)
    engine._config = SimpleNamespace(wall_clock_breakdown=False)
    engine.grid = SimpleNamespace(stage_to_global=lambda stage_id: stage_id)
    engine.device = torch.device("cpu")
    engine.has_attention_mask = engine.has_bool_tensors = engine.dynamic_shape = False
    engine.is_grad_partitioned = False
    engine.first_output_send = True
    engine.pending_sends = PendingSends()
    return engine


def _flag(rank: int) -> torch.Tensor:
    flag = torch.tensor([7.0 if rank == 0 else 0.0])
    if rank == 0:
        dist.send(flag, 1, tag=FLAG_TAG)  # blocking: returns once rank 1, which wants it first, has it
    else:
        dist.recv(flag, 0, tag=FLAG_TAG)
    return flag


def _send_instructions(rank: int):
    """Rank 0 runs DeepSpeed's SendActivation (metadata + activation) and SendGrad, then the flag."""
    activation, grad = _activation(), _activation() * -3
    if rank == 0:
        engine = _bare(AsyncSendPipelineEngine)
        engine.next_stage = engine.prev_stage = 1
        sent = activation.clone()
        inputs = torch.zeros(SHAPE, requires_grad=True)
        inputs.grad = grad.clone()
        engine.pipe_buffers = {"outputs": [sent], "inputs": [inputs]}
        blocking = ds_p2p.send
        engine._exec_send_activations(0)
        engine._exec_send_grads(0)
        restored = ds_p2p.send is blocking
        # The sender drops the sent storages while the sends are in flight; fresh tensors of that size would get
        # the freed memory (or it is unmapped) unless the pending send keeps it.
        sent.data = torch.full(SHAPE, -1.0)
        inputs.grad = None
        del inputs
        reuse = [torch.full(SHAPE, -2.0) for _ in range(4)]
        _flag(rank)
        in_flight = len(engine.pending_sends)
        engine.pending_sends.wait_all()
        del reuse
        return [
            ("DeepSpeed's p2p.send restored", torch.tensor(restored), torch.tensor(True)),
            ("sends held until the wait (metadata, activation, gradient)", torch.tensor(in_flight), torch.tensor(3)),
            ("pending after wait_all", torch.tensor(len(engine.pending_sends)), torch.tensor(0)),
        ]
    flag = _flag(rank)
    meta = torch.zeros(TENSOR_META_SIZE, dtype=torch.int32)
    got_activation, got_grad = torch.zeros(SHAPE), torch.zeros(SHAPE)
    for buffer in (meta, got_activation, got_grad):
        dist.recv(buffer, 0)
    dtype = PipelineEngine.DTYPE_TO_ID[torch.float32]
    return [
        ("flag", flag, torch.tensor([7.0])),
        ("shape metadata (tensor, dtype, ndims, shape)", meta[:5], torch.tensor([0, dtype, 2, *SHAPE]).int()),
        ("activation", got_activation, activation),
        ("gradient", got_grad, grad),
    ]


def _dualpipev_commit(rank: int):
    """Rank 0 commits a batch of one send and one receive (DualPipeV's CommitP2P), then the flag; rank 1's send
    is async too (it is posted before rank 1 asks for the flag)."""
    theirs, ours = _activation() + 1, _activation() - 1
    if rank == 0:
        engine = _bare(AsyncSendDualPipeVEngine)
        received = torch.zeros(SHAPE)
        engine._p2p_ops = [ds_dist.P2POp(ds_dist.isend, ours.clone(), 1), ds_dist.P2POp(ds_dist.irecv, received, 1)]
        engine._exec_commit_p2p()
        got_before_flag = received.clone()  # the commit returned with its receive complete
        _flag(rank)
        engine.pending_sends.wait_all()
        return [
            ("received at the commit", got_before_flag, theirs),
            ("ops cleared", torch.tensor(len(engine._p2p_ops)), torch.tensor(0)),
            ("pending after wait_all", torch.tensor(len(engine.pending_sends)), torch.tensor(0)),
        ]
    work = dist.isend(theirs, 0)
    flag = _flag(rank)
    got = torch.zeros(SHAPE)
    dist.recv(got, 0)
    work.wait()
    return [("flag", flag, torch.tensor([7.0])), ("sent by the commit", got, ours)]


def _run_rank(group, rank: int, world: int) -> dict[str, str]:
    checks = {
        "send instructions": lambda ctx: _send_instructions(rank),
        "dualpipev commit": lambda ctx: _dualpipev_commit(rank),
    }
    return run_checks(checks, None)


def test_sends_return_before_the_receiver_asks_and_arrive_intact():
    reports = spawn_reports(_run_rank, 2)
    message = "\n".join(failures(reports, name, "p2p") for name in ("send instructions", "dualpipev commit"))
    assert not message.strip(), message


class _Send:
    """A send handle that never completes by itself (as gloo's, whose ``is_completed()`` stays False until
    ``wait()``); records its wait."""

    def __init__(self, log: list):
        self.log = log

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        self.log.append("wait")


@pytest.mark.parametrize("name", [s.name for s in PIPELINE_SCHEDULES])
def test_every_schedule_waits_for_its_sends_before_the_step_reductions(monkeypatch, name):
    """Each schedule's engine dispatches its sends (and DualPipeV's commit) to ``AsyncSendSteps``, and the sends
    still pending are waited for by the step's first reduction, before DeepSpeed's, and after the schedule."""
    log: list = []
    monkeypatch.setattr(PipelineEngine, "_exec_reduce_tied_grads", lambda self: log.append("reduce"))
    monkeypatch.setattr(PipelineEngine, "_exec_schedule", lambda self, s: log.append("schedule"))
    cls = ENGINES[name]
    assert issubclass(cls, AsyncSendSteps)
    table = cls._INSTRUCTION_MAP
    assert table[schedule.SendActivation] is AsyncSendSteps._exec_send_activations
    assert table[schedule.SendGrad] is AsyncSendSteps._exec_send_grads
    assert table.get(schedule.CommitP2P, AsyncSendSteps._exec_commit_p2p) is AsyncSendSteps._exec_commit_p2p
    engine = _bare(cls)
    engine.weight_grad_queue = WeightGradQueue()
    for _ in range(2):
        engine.pending_sends._keep(_Send(log), torch.zeros(1))
    table[schedule.ReduceTiedGrads](engine)
    assert log == ["wait", "wait", "reduce"] and not len(engine.pending_sends)
    engine.pending_sends._keep(_Send(log), torch.zeros(1))
    engine._exec_schedule(None)  # eval: no reductions; nothing of a step is left pending for the next
    assert log[3:] == ["schedule", "wait"] and not len(engine.pending_sends)
