"""The overlapped data-parallel reduction (``pipeline_parallel.grad_reduce``) on a stand-in engine, without processes.

The engine runs a real schedule's instructions (two micro-batches: F B F B, then ReduceGrads) through the overlap's
own table and ``_exec_schedule``; ``torch.distributed.all_reduce`` is replaced by a recorder that adds a peer's
gradient (3x this rank's) and returns a handle, so what is reduced, when and on which device can be read.

Device contract: NCCL reduces CUDA tensors only ("No backend type associated with device type cpu"), and gloo
forgives a CPU tensor, so on CPU the contract is checked with the model on the meta device: any tensor the overlap
built on the CPU (a factory without ``device=``) would show up as a CPU tensor handed to the collective.
"""

from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.pipe import schedule
from torch import nn

from ds_megatron.config import ConfigError, parse_section
from ds_megatron.pipeline_parallel import grad_reduce
from ds_megatron.pipeline_parallel.grad_reduce import install_grad_reduce_overlap, overlap_refusal

PEER = 3.0  # the recorder's peer holds PEER x this rank's gradient: the sum is (1 + PEER) x


class _Grid:
    def get_data_parallel_group(self):
        return "dp"


class FakeEngine:
    """The parts of DeepSpeed's pipeline engine the overlap touches, running F/B on a small model."""

    mpu = _Grid()
    pipeline_enable_backward_allreduce = True
    gradient_average = True
    using_bf16_optimizer = False
    has_moe_layers = False
    communication_data_type = torch.float32
    _force_grad_boundary = False

    def __init__(self, device: str, extra_backward: bool = False):
        torch.manual_seed(0)
        self.module = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 2)).to(device)
        self.device, self.in_backward, self.extra_backward = device, False, extra_backward
        self.inputs = [torch.randn(3, 4).to(device) for _ in range(2)]

    def postscale_gradients(self):
        return True

    def gradient_predivide_factor(self):
        return 1.0

    def zero_optimization(self):
        return False

    def fp16_enabled(self):
        return False

    def _exec_forward_pass(self, buffer_id):
        self.loss = self.module(self.inputs[buffer_id]).square().sum()

    def _exec_backward_pass(self, buffer_id):
        self.in_backward = True
        self.loss.backward(retain_graph=self.extra_backward)
        if self.extra_backward:  # a second autograd call in the same pass (a routed stage's boundary statistics)
            self.loss.backward()
        self.in_backward = False

    def _exec_reduce_grads(self):
        raise AssertionError("DeepSpeed's own reduction must not run with the overlap")

    _INSTRUCTION_MAP = {
        schedule.ForwardPass: _exec_forward_pass,
        schedule.BackwardPass: _exec_backward_pass,
        schedule.ReduceGrads: _exec_reduce_grads,
    }

    def _exec_schedule(self, pipe_schedule):
        for cmds in pipe_schedule:
            for cmd in cmds:
                self._INSTRUCTION_MAP[type(cmd)](self, **cmd.kwargs)

    def train_step(self):
        for p in self.module.parameters():
            p.grad = None
        steps = [[schedule.ForwardPass(0)], [schedule.BackwardPass(0)], [schedule.ForwardPass(1)]]
        self._exec_schedule(_Steps([*steps, [schedule.BackwardPass(1)], [schedule.ReduceGrads()]]))


class _Steps(list):
    def num_pipe_buffers(self):
        return 2


@pytest.fixture
def recorded(monkeypatch):
    """Every all-reduce the overlap starts: (tensor's device, dtype, group, elements, inside a backward pass)."""
    calls = []

    class Work:
        def wait(self):
            pass

    def all_reduce(tensor, group=None, async_op=False):
        calls.append((tensor.device, tensor.dtype, group, tensor.numel(), ENGINE[0].in_backward))
        tensor.mul_(1 + PEER)
        return Work()

    ENGINE: list = []
    monkeypatch.setattr(grad_reduce.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(grad_reduce.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(grad_reduce, "BUCKET_ELEMENTS", 80)  # several buckets for this model
    return calls, ENGINE


def reference_grads(device: str) -> list[torch.Tensor]:
    """DeepSpeed's result for the same step: the accumulated gradients, summed with the peer's, times 1/dp."""
    engine = FakeEngine(device)
    for b in range(2):
        engine._exec_forward_pass(b)
        engine.loss.backward()
    return [p.grad * (1 + PEER) * (1.0 / 2) for p in engine.module.parameters()]


def test_every_reduced_tensor_is_on_the_models_device_in_fp32(recorded):
    calls, holder = recorded
    engine = FakeEngine("meta")
    holder.append(engine)
    install_grad_reduce_overlap(engine, late=[])
    for _ in range(2):
        engine.train_step()
    assert calls and {(device.type, dtype) for device, dtype, *_ in calls} == {("meta", torch.float32)}


def test_buckets_start_in_the_last_backward_once_learned_and_sum_like_deepspeed(recorded):
    calls, holder = recorded
    engine = FakeEngine("cpu")
    holder.append(engine)
    late = [engine.module[1].weight]  # as a tied or SP-replicated parameter: reduced at ReduceGrads only
    overlap = install_grad_reduce_overlap(engine, late=late)
    expected = reference_grads("cpu")
    sizes = [sum(p.numel() for p in b.params) for b in overlap.buckets]
    assert len(sizes) > 2 and overlap.num_early == len(sizes) - 1
    for step in range(3):
        calls.clear()
        engine.train_step()
        assert [n for *_, n, _ in calls] == sizes, step  # one order on every rank and step
        in_backward = [inside for *_, inside in calls]
        # step 0 learns the stream: everything after the last backward; then the early buckets inside it
        assert in_backward == ([False] * len(sizes) if step == 0 else [True] * (len(sizes) - 1) + [False]), step
        assert {group for _, _, group, *_ in calls} == {"dp"}
        for p, want in zip(engine.module.parameters(), expected, strict=True):
            assert torch.equal(p.grad, want), step


def test_a_second_autograd_call_in_the_last_pass_is_learned(recorded):
    """A routed stage runs one backward per floating boundary tensor: a parameter fires twice in a pass, and its
    gradient is final at the second firing."""
    calls, holder = recorded
    engine = FakeEngine("cpu", extra_backward=True)
    holder.append(engine)
    install_grad_reduce_overlap(engine, late=[])
    ref = FakeEngine("cpu")
    for b in range(2):
        ref._exec_forward_pass(b)
        ref.loss.backward(retain_graph=True)
        ref.loss.backward()
    expected = [p.grad * (1 + PEER) * 0.5 for p in ref.module.parameters()]
    for _ in range(2):
        engine.train_step()
        for p, want in zip(engine.module.parameters(), expected, strict=True):
            assert torch.equal(p.grad, want)
    assert all(inside for *_, inside in calls[-len(engine.grad_reduce_overlap.buckets) :])


def test_a_gradient_after_its_reduction_started_is_an_error(recorded):
    calls, holder = recorded
    engine = FakeEngine("cpu")
    holder.append(engine)
    overlap = install_grad_reduce_overlap(engine, late=[])
    engine.train_step()
    overlap.learned = {pid: (0, 1) for pid in overlap.learned}  # wrongly: final after the first micro-batch
    with pytest.raises(RuntimeError, match="overlap_grad_reduce false"):
        engine.train_step()


def test_paths_left_to_deepspeed_say_why():
    engine = FakeEngine("cpu")
    assert overlap_refusal(engine) is None
    engine.communication_data_type = torch.bfloat16
    assert "communication_data_type" in overlap_refusal(engine)
    engine.communication_data_type = torch.float32
    engine.zero_optimization = lambda: True  # ZeRO's optimizer (not the BF16 one)
    assert "ZeRO" in overlap_refusal(engine)
    engine.using_bf16_optimizer = True  # bf16 with ZeRO-1: the BF16 optimizer's fp32 buffers, reduced here
    assert overlap_refusal(engine) is None


def test_the_setting_is_a_bool_on_by_default():
    assert parse_section({}).parallel.overlap_grad_reduce is True
    with pytest.raises(ConfigError, match="overlap_grad_reduce"):
        parse_section({"parallel": {"overlap_grad_reduce": "yes"}})
