"""DualPipeV with deferred weight gradients (``dualpipev-zb``): the schedule (unit tier); the trained result rides in
the DualPipeV launches of tests/launcher/test_parity.py.

Unit tier: with the W passes removed, every rank's stream is DeepSpeed's DualPipeVSchedule, instruction for
instruction (same communication order and commits, so no new deadlock); every backward pass gets exactly one W pass,
no W pass runs before its backward, rank r holds at most r + 1 queued and none is left for the step's reductions.
A timing model of DeepSpeed's batched p2p (a CommitP2P launches the queued sends and receives and waits for every
partner) shows the bubble of a step (its makespan less the 2m (T_F + T_B + T_W) a rank computes) falling from
DualPipeV's 5p - 6 slots to 2(p - 1) at T_F = T_B = T_W, and by 30% or more at the costs measured on CPU
(T_F 1.6, T_B 1.4, T_W 1), for p 2 to 8; running the W passes before the slot's commit instead of after it (the
other place they could go) is worse.  The engine's optimizer step refuses to run with W passes queued.

Launcher tier (tests/launcher/test_parity.py, in the launches that already train DualPipeV): tp 1 x pp 2 with full
recompute and Llama at tp 2 x pp 2 with SP and full recompute train like the single-device model (within fp32
rounding); at tp 1 the losses and gradient norms are DualPipeV's bit for bit (measured by hand at tp 2 with SP and
selective recompute too); tests/workers/schedule_checkpoint.py's bf16 + ZeRO-1 steps give DualPipeV's losses and
gradient norm bit for bit.
"""

from __future__ import annotations

import pytest
from deepspeed.runtime.pipe import schedule as ds
from test_tune_schedule import batched_p2p_makespan as makespan
from tiny import gpt_tiny

from ds_megatron.pipeline_parallel.dualpipev_zb import DualPipeVZeroBubbleSchedule
from ds_megatron.pipeline_parallel.zero_bubble import WeightGradPass

CASES = [(p, m) for p in (2, 3, 4, 8) for m in (2 * p, 2 * p + 1, 3 * p)]


def streams(cls, p: int, m: int) -> list[list]:
    return [[cmd for step in cls(m, p, r).steps() for cmd in step] for r in range(p)]


def bubbles(p: int, m: int, f: float, b: float, w: float, per_rank=None) -> tuple[float, float]:
    """(DualPipeV's, DualPipeV-ZB's) makespan less the 2m (f + b + w) every rank computes."""
    work = 2 * m * (f + b + w)
    whole = makespan(streams(ds.DualPipeVSchedule, p, m), {ds.ForwardPass: f, ds.BackwardPass: b + w})
    split = {ds.ForwardPass: f, ds.BackwardPass: b, WeightGradPass: w}
    zb = makespan(per_rank or streams(DualPipeVZeroBubbleSchedule, p, m), split)
    return whole - work, zb - work


@pytest.mark.parametrize("p,m", CASES)
def test_dualpipev_zb_is_dualpipev_plus_one_w_per_backward(p, m):
    for rank, (zb, ref) in enumerate(
        zip(streams(DualPipeVZeroBubbleSchedule, p, m), streams(ds.DualPipeVSchedule, p, m))
    ):
        assert [repr(c) for c in zb if not isinstance(c, WeightGradPass)] == [repr(c) for c in ref]
        pending, most, reduced = 0, 0, False
        for cmd in zb:
            if isinstance(cmd, ds.BackwardPass):
                pending += 1
                most = max(most, pending - 1)  # held besides the one just queued
            elif isinstance(cmd, WeightGradPass):
                assert not reduced, f"rank {rank}: a W pass after the reductions began"
                pending -= 1
                assert pending >= 0, f"rank {rank}: a W pass before its backward"
            elif isinstance(cmd, ds.ReduceTiedGrads):
                assert pending == 0, f"rank {rank}: {pending} W passes left at the reductions"
                reduced = True
        assert reduced and most == rank, (rank, most)
        # every deferred W pass had a slot: none is added in front of the reductions
        step = next(
            s
            for s in DualPipeVZeroBubbleSchedule(m, p, rank).steps()
            if any(isinstance(c, ds.OptimizerStep) for c in s)
        )
        assert not any(isinstance(c, WeightGradPass) for c in step)
    forward_only = DualPipeVZeroBubbleSchedule(m, p, 0, forward_only=True)
    assert [repr(c) for s in forward_only.steps() for c in s] == [
        repr(c) for s in ds.DualPipeVSchedule(m, p, 0, forward_only=True).steps() for c in s
    ]


@pytest.mark.parametrize("p,m", CASES)
def test_deferred_w_lowers_the_bubble(p, m):
    whole, zb = bubbles(p, m, 1, 1, 1)
    assert whole == 5 * p - 6 and zb == 2 * (p - 1)
    # the costs measured on CPU (tests/workers/zero_bubble.py --measure): F dearer than B, W the cheapest
    whole, zb = bubbles(p, m, 1.6, 1.4, 1.0)
    assert zb <= 0.7 * whole
    # A W pass after its slot's commit: the sends of the backward before it are on their way while it computes;
    # before the commit, the peer that waits for them waits for the W pass too.
    before = []
    for stream in streams(DualPipeVZeroBubbleSchedule, p, m):
        stream = list(stream)
        for i in range(1, len(stream)):
            if isinstance(stream[i], WeightGradPass) and isinstance(stream[i - 1], ds.CommitP2P):
                stream[i - 1], stream[i] = stream[i], stream[i - 1]
        before.append(stream)
    assert bubbles(p, m, 1, 1, 1, per_rank=before)[1] > 2 * (p - 1)


def test_a_changed_deepspeed_schedule_is_refused():
    """The W slots are found by counting DeepSpeed's steps: a schedule that yields another count raises before its
    first step is handed to the engine, instead of placing W passes at the wrong commits."""

    class Longer(DualPipeVZeroBubbleSchedule):
        pass

    original = ds.DualPipeVSchedule.steps

    def extra_step(self):
        yield from original(self)
        yield [ds.CommitP2P()]

    ds.DualPipeVSchedule.steps = extra_step
    try:
        with pytest.raises(RuntimeError, match="yielded .* steps"):
            next(iter(Longer(4, 2, 0).steps()))
    finally:
        ds.DualPipeVSchedule.steps = original


def test_the_optimizer_step_refuses_queued_w_passes():
    import torch

    from ds_megatron.pipeline_parallel.dualpipev_zb import DualPipeVZeroBubbleEngine
    from ds_megatron.tensor_parallel.weight_grad import WeightGradQueue

    engine = DualPipeVZeroBubbleEngine.__new__(DualPipeVZeroBubbleEngine)  # no DeepSpeed initialisation needed
    engine.weight_grad_queue = WeightGradQueue()
    engine.using_bf16_optimizer = False
    p = torch.zeros(1, requires_grad=True)
    for _ in range(2):
        engine.weight_grad_queue.defer((p,), lambda: (torch.ones(1),))
        engine.weight_grad_queue.seal()
    engine._exec_weight_grad_pass()
    assert len(engine.weight_grad_queue) == 1 and p.grad.item() == 1.0
    with pytest.raises(RuntimeError, match="1 W pass"):
        engine._exec_optimizer_step()


def test_the_schedule_is_a_config_value():
    from ds_megatron.config import ConfigError, resolve
    from ds_megatron.pipeline_parallel.dualpipev import DualPipeVModel
    from ds_megatron.pipeline_parallel.schedules import module_class

    model = gpt_tiny()
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4, "train_batch_size": 4}
    cfg["ds_megatron"] = {"model": model, "parallel": {"pipeline_schedule": "dualpipev-zb", "pp": 2}}
    assert resolve(cfg, 2).section.parallel.pipeline_schedule == "dualpipev-zb"
    assert module_class("dualpipev-zb") is DualPipeVModel
    for extra, message in (
        ({"fp16": {"enabled": True}}, "error: fp16.enabled: fp16 under the dualpipev-zb schedule gives other"),
        (
            {"gradient_accumulation_steps": 3, "train_batch_size": 3},
            "error: gradient_accumulation_steps: the dualpipev-zb schedule needs at least 2 x pp micro-batches",
        ),
    ):
        with pytest.raises(ConfigError) as err:
            resolve({**cfg, **extra}, 2)
        assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("p,m", CASES)
def test_the_tuners_order_and_makespan_are_the_schedules(p, m):
    """The tuner's pass order is the schedule's stream, and its list scheduling gives the batched-p2p makespan of
    DeepSpeed's streams at the time model's F : B : W = 1 : 1 : 1 (at other ratios it is a model, within a chunk
    forward of the streams' here)."""
    from ds_megatron.pipeline_parallel.schedules import dualpipev_zb
    from ds_megatron.pipeline_parallel.schedules.dualpipev import slots as dualpipev_slots
    from ds_megatron.pipeline_parallel.schedules.v_order import compute_order

    for rank, stream in enumerate(streams(DualPipeVZeroBubbleSchedule, p, m)):
        passes, queued = [], []
        for i, cmd in enumerate(stream):
            if isinstance(cmd, ds.ForwardPass):
                passes.append(("F", cmd.phase))
            elif isinstance(cmd, ds.BackwardPass):
                whole = isinstance(stream[i + 1], WeightGradPass)
                passes.append(("BW" if whole else "B", cmd.phase))
                queued += [] if whole else [cmd.phase]
            elif isinstance(cmd, WeightGradPass) and not isinstance(stream[i - 1], ds.BackwardPass):
                passes.append(("W", queued.pop(0)))
        assert passes == compute_order(p, m, rank)
    split = {ds.ForwardPass: 1.0, ds.BackwardPass: 1.0, WeightGradPass: 1.0}
    assert dualpipev_zb.simulate(p, m, 1.0, 1.0, 1.0) == makespan(streams(DualPipeVZeroBubbleSchedule, p, m), split)
    for f, b, w in ((1.6, 1.4, 1.0), (2.0, 1.0, 1.0)):
        split = {ds.ForwardPass: f, ds.BackwardPass: b, WeightGradPass: w}
        simulated = makespan(streams(DualPipeVZeroBubbleSchedule, p, m), split)
        assert abs(dualpipev_zb.simulate(p, m, f, b, w) - simulated) <= f
    assert m < dualpipev_zb.slots(p, m) < dualpipev_slots(p, m)  # fewer bubble slots than DualPipeV's


def test_the_tuner_models_dualpipev_zb_as_the_v_with_its_drain():
    """Same layout as DualPipeV (parameters, blocks per rank, p2p per chunk), a smaller bubble, and the memory of
    DualPipeV plus what the drain's queued W passes keep beyond the chunks their backward passes freed."""
    import dataclasses

    from ds_megatron.pipeline_parallel.schedules.dualpipev import peak_bytes as dualpipev_peak_bytes
    from ds_megatron.pipeline_parallel.schedules.dualpipev_zb import peak_bytes
    from ds_megatron.tune import Candidate, build_model_shape
    from ds_megatron.tune.core.memory_model import rank_param_counts, stage_activation_bytes
    from ds_megatron.tune.training.schedules import refusal
    from ds_megatron.tune.training.time_model import StageTime, schedule_slots, stage_blocks

    model = build_model_shape("gpt3-1.3b", None, None, None, None, None)
    base = dict(tp=2, pp=4, dp=1, sequence_parallel=True, micro_batch_size=1, num_micro_batches=16)
    base.update(recompute="selective", attention="sdpa", recompute_modules=("mlp_act",))
    dv = Candidate(**base, schedule="dualpipev")
    zb = dataclasses.replace(dv, schedule="dualpipev-zb")
    assert rank_param_counts(model, zb) == rank_param_counts(model, dv)
    assert stage_blocks(model, zb) == stage_blocks(model, dv)
    stage = StageTime(compute_s=1.0, tp_comm_s=0.0, p2p_s=0.0, weight_grad_s=1 / 3)
    assert schedule_slots(zb, stage)[1] < schedule_slots(dv, stage)[1]
    first_dv, last_dv = stage_activation_bytes(model, dv)
    first_zb, last_zb = stage_activation_bytes(model, zb)
    assert first_zb >= first_dv and last_zb >= last_dv
    # nothing queued at any forward: with W passes that keep nothing, DualPipeV's peak exactly
    for rank in range(4):
        assert peak_bytes(4, 16, rank, (1.0, 1.0), (0.0, 0.0)) == dualpipev_peak_bytes(4, 16, rank, (1.0, 1.0))
    # the drain's queued W passes (r + 1 at most) stay under the 2p + 1 = 9 chunks' peak while one keeps up to two
    # chunks' activations (about one in practice: its linears' inputs and output gradients), above beyond
    for p, m in CASES:
        for r in range(p):
            assert peak_bytes(p, m, r, (1.0, 1.0), (2.0, 2.0)) == dualpipev_peak_bytes(p, m, r, (1.0, 1.0))
    assert peak_bytes(4, 16, 3, (1.0, 1.0), (3.0, 3.0)) == 12.0
    assert (
        refusal("dualpipev-zb", 1, 8)
        == "dualpipev-zb needs pp > 1 (each pipeline rank holds two stages of one pipeline)"
    )
    assert refusal("dualpipev-zb", 4, 7).startswith("dualpipev-zb needs m >= 2 x pp")
