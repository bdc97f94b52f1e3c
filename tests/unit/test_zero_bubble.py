"""ZB-H1 on DeepSpeed's pipeline engine: the schedule (unit tier) and the trained result (one launcher run).

Unit tier: with the W passes removed, the ZB-H1 stream of every stage is DeepSpeed's 1F1B stream, instruction for
instruction (same communication order, so no new deadlock); every backward pass gets exactly one W pass, no W pass
runs before its backward, stage s holds at most s when it runs a forward, and all have run before the step's
reductions.  A timing model of the streams (T_F = T_B = T_W; a send and its receive block until both sides are
there, as DeepSpeed's p2p does) shows the bubble going from 1F1B's (p-1)(T_F+T_B+T_W) to ZB-H1's (p-1)(T_F+T_B-T_W),
and, with the costs measured on CPU (T_F 1.6, T_B 1.4, T_W 1), halving.  The schedule key
is validated before anything starts.  The engine's W instruction frames each W pass for DeepSpeed's BF16 optimizer
like a backward pass, and its optimizer step refuses to run with W passes queued.

Launcher tier (one run, 2 processes, pp 2): GPT-2 (tied embeddings across the two stages) and Llama (untied) in
fp32, and GPT-2 with DeepSpeed's BF16 optimizer (ZeRO-1, fp32 accumulators), each train three steps with 1F1B and
with ZB-H1: losses, step-1 gradients (bf16: the fp32 accumulators) and the weights after three steps agree within
fp32 rounding (measured: bit for bit), and ZB-H1 ran one W pass with deferred work per micro-batch.
"""

from __future__ import annotations

import pytest
from deepspeed.runtime.pipe import schedule as ds

from ds_megatron.parallel.zero_bubble import WeightGradPass, ZeroBubbleH1Schedule


def streams(cls, m: int, p: int) -> list[list]:
    return [[cmd for step in cls(micro_batches=m, stages=p, stage_id=s) for cmd in step] for s in range(p)]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_zb_h1_is_1f1b_plus_one_w_per_backward(m, p):
    for stage, (zb, ref) in enumerate(zip(streams(ZeroBubbleH1Schedule, m, p), streams(ds.TrainSchedule, m, p))):
        assert [repr(c) for c in zb if not isinstance(c, WeightGradPass)] == [repr(c) for c in ref]
        pending, reduced = 0, False
        for cmd in zb:
            if isinstance(cmd, ds.BackwardPass):
                pending += 1
            elif isinstance(cmd, WeightGradPass):
                assert not reduced, f"stage {stage}: a W pass after the reductions began"
                pending -= 1
                assert pending >= 0, f"stage {stage}: a W pass before its backward"
            elif isinstance(cmd, ds.ReduceTiedGrads):
                assert pending == 0, f"stage {stage}: {pending} W passes left at the reductions"
                reduced = True
            if isinstance(cmd, ds.ForwardPass):  # where memory grows: at most `stage` W passes held
                assert pending <= stage, f"stage {stage} holds {pending} W passes at a forward"
        assert reduced


CHANNELS = {  # instruction -> (which link, offset of the link's upstream stage from this one)
    ds.SendActivation: ("activation", 0),
    ds.RecvActivation: ("activation", -1),
    ds.SendGrad: ("grad", -1),
    ds.RecvGrad: ("grad", 0),
}
COMPUTE = {ds.ForwardPass: "F", ds.BackwardPass: "B", WeightGradPass: "W"}


def makespan(per_stage: list[list], cost: dict) -> float:
    """Finish time of the stages' streams when compute takes ``cost`` and a send and its receive (the n-th on a
    link between two stages) both block until the other side is there, as DeepSpeed's blocking p2p does."""
    p = len(per_stage)
    clock, position, blocked = [0.0] * p, [0] * p, [False] * p
    posted: dict = {}  # (link, upstream stage, n) -> (stage waiting, since when)
    sent: list[dict] = [{} for _ in range(p)]
    while any(position[s] < len(per_stage[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while position[s] < len(per_stage[s]) and not blocked[s]:
                cmd = per_stage[s][position[s]]
                if type(cmd) in CHANNELS:
                    link, offset = CHANNELS[type(cmd)]
                    n = sent[s].get(type(cmd), 0)
                    sent[s][type(cmd)] = n + 1
                    key = (link, s + offset, n)
                    progressed = True
                    if key not in posted:
                        posted[key] = (s, clock[s])
                        blocked[s] = True
                        break
                    other, since = posted.pop(key)
                    clock[s] = clock[other] = max(clock[s], since)
                    position[other] += 1
                    blocked[other] = False
                else:
                    clock[s] += cost.get(COMPUTE.get(type(cmd)), 0)
                position[s] += 1
                progressed = True
        assert progressed, "the streams deadlock"
    return max(clock)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_zb_h1_bubble_is_a_third_of_1f1b(p, m):
    one_f_one_b = makespan(streams(ds.TrainSchedule, m, p), {"F": 1, "B": 2})
    zb = makespan(streams(ZeroBubbleH1Schedule, m, p), {"F": 1, "B": 1, "W": 1})
    assert one_f_one_b - 3 * m == (p - 1) * 3
    assert zb - 3 * m == (p - 1) * 1
    # Forward dearer than B, as measured on CPU (tests/workers/zero_bubble.py --measure): the bubble still halves.
    one_f_one_b = makespan(streams(ds.TrainSchedule, m, p), {"F": 1.6, "B": 2.4})
    zb = makespan(streams(ZeroBubbleH1Schedule, m, p), {"F": 1.6, "B": 1.4, "W": 1.0})
    assert zb - 4 * m == pytest.approx((one_f_one_b - 4 * m) / 2)


@pytest.mark.parametrize(
    "schedule,fp16,message",
    [
        (
            "zb",
            False,
            "error: ds_megatron.parallel.pipeline_schedule: unknown schedule (got 'zb'); "
            "use one of ['1f1b', 'dualpipev', 'zb-h1', 'dualpipev-zb']",
        ),
        (
            "zb-h1",
            True,
            "error: ds_megatron.parallel.pipeline_schedule: zb-h1 is not supported with fp16 "
            "(pipeline_schedule='zb-h1', fp16.enabled=true); use bf16 or fp32, or pipeline_schedule \"1f1b\"",
        ),
    ],
    ids=["unknown", "fp16"],
)
def test_pipeline_schedule_is_validated(schedule, fp16, message):
    from ds_megatron.config import ConfigError, resolve

    model = {"size": "gpt-tiny", "vocab_size": 1000, "seq_length": 32}
    cfg = {"train_micro_batch_size_per_gpu": 1, "ds_megatron": {"model": model}}
    cfg["ds_megatron"]["parallel"] = {"pipeline_schedule": schedule, "pp": 2}
    if fp16:
        cfg["fp16"] = {"enabled": True}
    with pytest.raises(ConfigError) as err:
        resolve(cfg, 2)
    assert str(err.value) == message
    cfg["ds_megatron"]["parallel"] = {"pipeline_schedule": "zb-h1", "pp": 2}
    cfg.pop("fp16", None)
    assert resolve(cfg, 2).section.parallel.pipeline_schedule == "zb-h1"


class _FakeBF16Optimizer:
    """Records the calls DeepSpeed's BF16 optimizer gets around a W pass."""

    def __init__(self, calls: list):
        self.calls = calls

    def clear_lp_grads(self):
        self.calls.append("clear")

    def update_hp_grads(self, clear_lp_grads=False):
        self.calls.append("update")


def _fake_engine(calls: list, queue, bf16: bool):
    from types import SimpleNamespace

    from ds_megatron.parallel.zero_bubble import ZeroBubblePipelineEngine

    engine = ZeroBubblePipelineEngine.__new__(ZeroBubblePipelineEngine)  # no DeepSpeed initialisation needed here
    engine.weight_grad_queue = queue
    engine.using_bf16_optimizer = bf16
    engine.optimizer = _FakeBF16Optimizer(calls)
    engine._config = SimpleNamespace(bfloat16_config=SimpleNamespace(immediate_grad_update=False))
    return engine


def test_w_pass_moves_bf16_gradients_once_and_the_step_refuses_leftovers():
    """Under the BF16 optimizer each W pass is framed like a backward pass (16-bit gradients zeroed before, added to
    the fp32 accumulators after), one W pass per instruction, all of them at the reductions; an optimizer step that
    finds W passes queued raises instead of stepping on partial gradients."""
    import torch

    from ds_megatron.parallel.zero_bubble import ZeroBubblePipelineEngine
    from ds_megatron.tensor_parallel.weight_grad import WeightGradQueue

    calls: list = []
    queue = WeightGradQueue()
    p = torch.zeros(1, requires_grad=True)
    for i in range(3):
        queue.defer((p,), lambda i=i: (calls.append(f"W{i}") or torch.ones(1),))
        queue.seal()
    engine = _fake_engine(calls, queue, bf16=True)
    engine._exec_weight_grad_pass()
    assert calls == ["clear", "W0", "update"] and len(queue) == 2
    with pytest.raises(RuntimeError, match="2 W pass"):
        ZeroBubblePipelineEngine._exec_optimizer_step(engine)
    engine._run_weight_grads(all_of_them=True)  # what ReduceTiedGrads runs first
    assert calls == ["clear", "W0", "update", "clear", "W1", "update", "clear", "W2", "update"]
    assert len(queue) == 0 and p.grad.item() == 3.0
    plain: list = []
    queue.defer((p,), lambda: (plain.append("W") or torch.ones(1),))
    _fake_engine(plain, queue, bf16=False)._exec_weight_grad_pass()  # fp32: .grad directly, no framing
    assert plain == ["W"] and p.grad.item() == 4.0
